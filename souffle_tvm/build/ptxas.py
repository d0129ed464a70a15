"""Per-kernel registers, shared memory and spills, read from ptxas (``nvcc --resource-usage``).

Results and the cubin are cached on disk by (source, arch) so a kernel is never compiled twice
(the GPU check ships the same cubins the figures come from). When nvcc
is absent, ``measure`` returns ``None`` and callers report "no resource figures" instead of
failing.

The cache (``$SOUFFLE_TVM_CACHE/ptxas``, default ``~/.cache/souffle-tvm/ptxas``) holds
``<key>.cubin`` and ``<key>.json`` per (source, arch). Each is written atomically
(``core.files``), so compiles running at once, or one killed mid-way, never leave a partial
entry: concurrent compiles of the same source may both run nvcc, and the last rename wins
(the same bytes). An entry that is unusable anyway (JSON that does not parse, an empty or
non-ELF cubin: a disk that filled up, an older version's non-atomic write) is recompiled
with a one-line note (``CacheWarning``), never a traceback.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from ..core.files import atomic_copy, atomic_write, cache_root, is_elf, note_recomputed
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
    path = cache_root() / "ptxas"
    path.mkdir(parents=True, exist_ok=True)
    return path


_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\d+)'")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:, used (\d+) barriers)?")
# anywhere on the "Used" line: a kernel with a stack puts "N bytes cumulative stack size" before it
_SMEM = re.compile(r"(\d+) bytes smem")


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
            smem = _SMEM.search(line)
            out[current] = KernelResources(int(m.group(1)), int(smem.group(1)) if smem else 0, spill, stack,
                                           int(m.group(2) or 0))
            current = None
    return out


def first_errors(output: str, count: int = 4) -> str:
    """The first ``count`` errors in nvcc's output, each with the source line nvcc quotes under
    it: warnings come first and can run to hundreds of lines, so the tail may hold none. Output
    with no line naming an error keeps its last 8 lines."""
    lines = output.strip().splitlines()
    hits = [i for i, line in enumerate(lines) if re.search(r"\berror\b", line, re.IGNORECASE)]
    if not hits:
        return "\n".join(lines[-8:])
    shown: list[str] = []
    for i in hits[:count]:
        # nvcc's front end quotes the offending source line (and a caret line) after the message
        context = [line for line in lines[i + 1:i + 3] if line.strip() and not re.search(r"\b(error|warning)\b", line)]
        shown += [lines[i]] + context
    more = len(hits) - count
    return "\n".join(shown + ([f"... and {more} more error line(s)"] if more > 0 else []))


# Bumped when parse_resource_usage reads ptxas differently: entries parsed before are not reused
# (2: the shared memory of kernels with a stack, which CUDA 13's ptxas prints after its size)
FIGURES_VERSION = 2


def cache_key(source: str, arch: str) -> str:
    """One CUDA source for one arch: the name of its cached cubin and resource figures."""
    return hashlib.sha256(f"{arch}\0{FIGURES_VERSION}\0{source}".encode()).hexdigest()[:32]


def _compile(source: str, arch: str, timeout: float) -> dict[str, KernelResources]:
    """nvcc once: the cubin, then the parsed ptxas figures, go to the cache, each atomically
    (the figures last: they are what ``measure`` takes as the entry)."""
    key = cache_key(source, arch)
    with tempfile.TemporaryDirectory(prefix="souffle_nvcc_") as tmp:
        cu, out = Path(tmp) / "kernels.cu", Path(tmp) / "k.cubin"
        cu.write_text(source)
        cmd = [nvcc_path(), "-cubin", f"-arch={arch}", "--resource-usage", "-O3", "-o", str(out), str(cu)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise ToolchainError(f"nvcc failed for {arch} (exit {proc.returncode}):\n"
                                 + first_errors(proc.stderr + proc.stdout))
        if not is_elf(out):
            raise ToolchainError(f"nvcc exited 0 for {arch} but wrote no cubin ({out})")
        atomic_copy(out, cache_dir() / f"{key}.cubin")     # the temp dir may be on another file system
    result = parse_resource_usage(proc.stdout + proc.stderr)
    atomic_write(cache_dir() / f"{key}.json", json.dumps({k: asdict(v) for k, v in result.items()}))
    return result


def _read_figures(path: Path) -> dict[str, KernelResources] | None:
    """A cached figures file, or None (with a note) when it cannot be read as one."""
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise ValueError(f"a JSON {type(data).__name__}, not an object")
        return {k: KernelResources(**v) for k, v in data.items()}
    except (OSError, ValueError, TypeError) as err:      # JSONDecodeError is a ValueError
        why = "empty file" if path.exists() and path.stat().st_size == 0 else f"{type(err).__name__}: {err}"
        note_recomputed(path, why[:160], "recompiling with nvcc")
        return None


def measure(source: str, arch: str, timeout: float = 600.0) -> dict[str, KernelResources] | None:
    """Compile CUDA ``source`` for ``arch`` with nvcc and return per-kernel resources.

    Returns ``None`` when nvcc is not installed; raises ToolchainError when nvcc rejects the code.
    """
    if nvcc_path() is None:
        return None
    cached = cache_dir() / f"{cache_key(source, arch)}.json"
    if cached.exists() and (figures := _read_figures(cached)) is not None:
        return figures
    return _compile(source, arch, timeout)


def cubin(source: str, arch: str, timeout: float = 600.0) -> Path | None:
    """The cubin ``measure`` compiled for ``source`` (compiled now if the cache has none, or
    an empty or cut one); ``None`` without nvcc."""
    path = cache_dir() / f"{cache_key(source, arch)}.cubin"
    if is_elf(path):
        return path
    if nvcc_path() is None:
        return None
    if path.exists():
        note_recomputed(path, "empty file" if path.stat().st_size == 0 else "not an ELF cubin", "recompiling with nvcc")
    _compile(source, arch, timeout)
    return path
