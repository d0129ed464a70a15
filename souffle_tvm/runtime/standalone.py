"""Run an exported library with the TVM *runtime* alone: no compiler, no ``tvm`` package.

A GPU machine may have CUDA, numpy and ``tvm_ffi`` but not TVM's 250 MB compiler. What an
exported Relax executable needs there is small: ``libtvm_runtime*.so`` (loaded with
RTLD_GLOBAL so the VM and the CUDA module loader register themselves in ``tvm_ffi``'s
registry) and, for CUDA, a compiler for the kernel *source* the library carries: TVM built
on a machine without a GPU keeps each CUDA module as source, and the runtime asks the global
``tvm_callback_cuda_compile`` for a binary when the module is first used. ``CubinStore``
answers it from cubins compiled beforehand with nvcc (by source hash), or runs nvcc itself.

Kept free of ``import tvm``: tested on the CPU against the full TVM build (tests/test_standalone.py).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
from pathlib import Path

from ..build import ptxas as resources
from ..build.ptxas import cache_key as cubin_key
from ..core.files import atomic_copy, is_elf, note_recomputed

RUNTIME_LIBS = ("libtvm_runtime.so", "libtvm_runtime_extra.so")
CUDA_RUNTIME_LIBS = ("libtvm_runtime_cuda.so",)
DL_CPU, DL_CUDA = 1, 2
POOLED_ALLOCATOR = 2


def installed_runtime_dir() -> Path:
    """Where the installed ``tvm`` package keeps its runtime libraries (found without importing it)."""
    spec = importlib.util.find_spec("tvm")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the tvm package is not installed here")
    return Path(list(spec.submodule_search_locations)[0]) / "lib"


class CubinStore:
    """Answers the runtime's ``tvm_callback_cuda_compile``: a stored cubin, else nvcc here."""

    def __init__(self, directory: str | os.PathLike, arch: str):
        self.dir, self.arch = Path(directory), arch
        self.hits = self.misses = 0

    def path(self, source: str) -> Path:
        return self.dir / f"{cubin_key(source, self.arch)}.cubin"

    def add(self, source: str) -> Path:
        """Keep ``source``'s cubin here: the one the resource report compiled (the build machine's
        side). Copied atomically; an empty or cut one already here is replaced."""
        p = self.path(source)
        if not self._usable(p):
            self.dir.mkdir(parents=True, exist_ok=True)
            atomic_copy(self._compiled(source), p)
        return p

    def __call__(self, source: str, *_target) -> bytes:
        p = self.path(source)
        if self._usable(p):
            self.hits += 1
            return p.read_bytes()
        self.misses += 1
        return self._compiled(source).read_bytes()

    @staticmethod
    def _usable(p: Path) -> bool:
        if is_elf(p):
            return True
        if p.exists():
            note_recomputed(p, "empty file" if p.stat().st_size == 0 else "not an ELF cubin",
                            "using the ptxas cache or nvcc instead")
        return False

    def _compiled(self, source: str) -> Path:
        path = resources.cubin(source, self.arch)
        if path is None:
            raise RuntimeError(f"no stored cubin for a CUDA module ({self.path(source).name}) and no nvcc to compile it")
        return path

    def register(self) -> None:
        import tvm_ffi

        tvm_ffi.register_global_func("tvm_callback_cuda_compile", self, override=True)


_loaded: set[str] = set()


def load_runtime(libdir: str | os.PathLike, cuda: bool) -> None:
    """Load TVM's runtime libraries into the process (idempotent).

    ``libcudart.so.13`` is taken from ``libdir`` when it is there (a machine whose CUDA
    runtime lives elsewhere still works: the dynamic linker then finds its own).
    """
    import tvm_ffi

    del tvm_ffi  # imported for its side effect: libtvm_ffi.so, which the runtime libraries link against

    libdir = Path(libdir)
    names = (["libcudart.so.13"] if cuda and (libdir / "libcudart.so.13").exists() else [])
    names += list(RUNTIME_LIBS) + (list(CUDA_RUNTIME_LIBS) if cuda else [])
    for name in names:
        path = str((libdir / name).resolve())
        if path not in _loaded:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            _loaded.add(path)


class VM:
    """A Relax executable loaded from an exported library, initialised on one device.

    ``vm(*args)`` takes ``tvm_ffi`` tensors (or anything with ``__dlpack__``: numpy arrays on
    the CPU, torch tensors on the GPU) and returns the outputs as a flat list of ``tvm_ffi``
    tensors.
    """

    def __init__(self, library: str | os.PathLike, device: str = "cuda", device_id: int = 0):
        import tvm_ffi

        self._ffi = tvm_ffi
        self.module = tvm_ffi.load_module(str(library))
        self.vm = self.module["vm_load_executable"]()
        if device == "cuda":
            init = (DL_CUDA, device_id, POOLED_ALLOCATOR, DL_CPU, 0, POOLED_ALLOCATOR)
        elif device == "cpu":
            init = (DL_CPU, 0, POOLED_ALLOCATOR)
        else:
            raise ValueError(f"device must be 'cuda' or 'cpu', not {device!r}")
        self.vm["vm_initialization"](*init)
        self.main = self.vm["main"]

    def tensor(self, array):
        return array if isinstance(array, self._ffi.Tensor) else self._ffi.from_dlpack(array)

    def __call__(self, *args) -> list:
        return flatten(self.main(*[self.tensor(a) for a in args]))


def flatten(out) -> list:
    if hasattr(out, "__dlpack__"):
        return [out]
    return [t for item in out for t in flatten(item)]
