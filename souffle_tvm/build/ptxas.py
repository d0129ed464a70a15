"""Per-kernel registers, shared memory and spills, read from ptxas (``nvcc --resource-usage``).

Results and the cubin are cached on disk by (source, arch) so a kernel is never compiled twice
(the GPU check ships the same cubins the figures come from). When nvcc
is absent, ``measure`` returns ``None`` and callers report "no resource figures" instead of
failing.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import ToolchainError


@dataclass(frozen=True)
class KernelResources:
    registers: int
    shared_bytes: int          # static shared memory per block, as ptxas allocates it
    spill_bytes: int           # spill stores + spill loads
    stack_bytes: int
    barriers: int


def nvcc_path() -> str | None:
    return shutil.which("nvcc")


def cache_dir() -> Path:
    root = os.environ.get("SOUFFLE_TVM_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "souffle-tvm")
    path = Path(root) / "ptxas"
    path.mkdir(parents=True, exist_ok=True)
    return path


_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\d+)'")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:, used (\d+) barriers)?(?:, (\d+) bytes smem)?")


def parse_resource_usage(text: str) -> dict[str, KernelResources]:
    """Parse ptxas ``-v`` output into {kernel name: resources}."""
    out: dict[str, KernelResources] = {}
    current, stack, spill = None, 0, 0
    for line in text.splitlines():
        if m := _ENTRY.search(line):
            current, stack, spill = m.group(1), 0, 0
        elif current and (m := _SPILL.search(line)):
            stack, spill = int(m.group(1)), int(m.group(2)) + int(m.group(3))
        elif current and (m := _USED.search(line)):
            out[current] = KernelResources(int(m.group(1)), int(m.group(3) or 0), spill, stack,
                                           int(m.group(2) or 0))
            current = None
    return out


def cache_key(source: str, arch: str) -> str:
    """One CUDA source for one arch: the name of its cached cubin and resource figures."""
    return hashlib.sha256(f"{arch}\0{source}".encode()).hexdigest()[:32]


def _compile(source: str, arch: str, timeout: float) -> dict[str, KernelResources]:
    """nvcc once: the cubin and the parsed ptxas figures both go to the cache."""
    key = cache_key(source, arch)
    with tempfile.TemporaryDirectory(prefix="souffle_nvcc_") as tmp:
        cu, out = Path(tmp) / "kernels.cu", Path(tmp) / "k.cubin"
        cu.write_text(source)
        cmd = [nvcc_path(), "-cubin", f"-arch={arch}", "--resource-usage", "-O3", "-o", str(out), str(cu)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-8:])
            raise ToolchainError(f"nvcc failed for {arch} (exit {proc.returncode}):\n{tail}")
        shutil.move(str(out), cache_dir() / f"{key}.cubin")
    result = parse_resource_usage(proc.stdout + proc.stderr)
    (cache_dir() / f"{key}.json").write_text(json.dumps({k: asdict(v) for k, v in result.items()}))
    return result


def measure(source: str, arch: str, timeout: float = 600.0) -> dict[str, KernelResources] | None:
    """Compile CUDA ``source`` for ``arch`` with nvcc and return per-kernel resources.

    Returns ``None`` when nvcc is not installed; raises ToolchainError when nvcc rejects the code.
    """
    if nvcc_path() is None:
        return None
    cached = cache_dir() / f"{cache_key(source, arch)}.json"
    if cached.exists():
        return {k: KernelResources(**v) for k, v in json.loads(cached.read_text()).items()}
    return _compile(source, arch, timeout)


def cubin(source: str, arch: str, timeout: float = 600.0) -> Path | None:
    """The cubin ``measure`` compiled for ``source`` (compiled now if the cache has none);
    ``None`` without nvcc."""
    path = cache_dir() / f"{cache_key(source, arch)}.cubin"
    if not path.exists():
        if nvcc_path() is None:
            return None
        _compile(source, arch, timeout)
    return path
