"""Per-kernel registers, shared memory and spills, read from ptxas (``nvcc --resource-usage``).

Results are cached on disk by (source, arch) so a kernel is never compiled twice. When nvcc
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

from .errors import ToolchainError


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


def measure(source: str, arch: str, timeout: float = 600.0) -> dict[str, KernelResources] | None:
    """Compile CUDA ``source`` for ``arch`` with nvcc and return per-kernel resources.

    Returns ``None`` when nvcc is not installed; raises ToolchainError when nvcc rejects the code.
    """
    nvcc = nvcc_path()
    if nvcc is None:
        return None
    key = hashlib.sha256(f"{arch}\0{source}".encode()).hexdigest()[:32]
    cached = cache_dir() / f"{key}.json"
    if cached.exists():
        return {k: KernelResources(**v) for k, v in json.loads(cached.read_text()).items()}
    with tempfile.TemporaryDirectory(prefix="souffle_nvcc_") as tmp:
        cu = Path(tmp) / "kernels.cu"
        cu.write_text(source)
        cmd = [nvcc, "-cubin", f"-arch={arch}", "--resource-usage", "-O3", "-o", str(Path(tmp) / "k.cubin"), str(cu)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-8:])
        raise ToolchainError(f"nvcc failed for {arch} (exit {proc.returncode}):\n{tail}")
    result = parse_resource_usage(proc.stdout + proc.stderr)
    cached.write_text(json.dumps({k: asdict(v) for k, v in result.items()}))
    return result
