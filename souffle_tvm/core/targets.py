"""Targets: CUDA (sm_90 by default, sm_80 too) and llvm as the CPU twin, as TVM dict targets."""

from __future__ import annotations

import re

import tvm

DEFAULT_ARCH = "sm_90"
SUPPORTED_ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90")


def make_target(spec: str = "cuda", arch: str | None = None) -> tvm.target.Target:
    """``cuda`` (optionally ``cuda -arch=sm_80``) or ``llvm`` → a ``tvm.target.Target``.

    TVM 0.27 rejects string targets with options, so the familiar ``-arch=`` form is parsed
    here and mapped to the dict form.
    """
    spec = spec.strip()
    m = re.search(r"-arch=(sm_\d+)", spec)
    if m:
        arch = arch or m.group(1)
        spec = spec[: m.start()].strip()
    kind = spec.split()[0] if spec else "cuda"
    if kind == "llvm":
        return tvm.target.Target({"kind": "llvm"})
    if kind != "cuda":
        raise ValueError(f"unsupported target {spec!r}: use 'cuda', 'cuda -arch=sm_80' or 'llvm'")
    arch = arch or DEFAULT_ARCH
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"unsupported CUDA arch {arch!r}; choose one of {', '.join(SUPPORTED_ARCHS)}")
    return tvm.target.Target({
        "kind": "cuda", "arch": arch, "max_shared_memory_per_block": 49152,
        "max_threads_per_block": 1024, "registers_per_block": 65536, "thread_warp_size": 32,
    })


def is_cuda(target: tvm.target.Target) -> bool:
    return target.kind.name == "cuda"


def describe(target: tvm.target.Target) -> str:
    return f"cuda -arch={target.attrs['arch']}" if is_cuda(target) else target.kind.name
