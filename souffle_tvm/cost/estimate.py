"""A static estimate of a stitched kernel's registers and shared memory, for when there is no
nvcc (and for growing candidate subprograms before anything is compiled).

Read off the stages' launch-form TIR: shared memory is the largest stage's shared and
``shared.dyn`` allocations (TVM's storage passes reuse them across stages), registers a base
plus the per-thread ``local`` words of the hungriest stage. ptxas is the truth; the estimate's
error against it on the zoo is measured by ``python/estimate_error.py`` and written in
docs/partitioner.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm_ffi
from tvm import tirx

from . import tir_stats
from ..core.geometry import STATIC_SHARED_LIMIT

# Fitted on the zoo's stitched kernels (docs/partitioner.md): a stage with no local buffers
# still needs address arithmetic and loop counters; stitching adds the grid-stride loops.
BASE_REGISTERS = 40
STITCH_REGISTERS = 16
MAX_REGISTERS = 255


@dataclass(frozen=True)
class Estimate:
    registers: int
    shared_bytes: int
    spills: bool          # the estimate is past the register limit: ptxas would spill

    @property
    def dynamic_shared(self) -> bool:
        """Over the 48 KB a kernel may declare statically: the build moves it to ``shared.dyn``
        (``build.dynamic_shared``) and the kernel opts in to its size at launch, so its limit is
        the GPU's opt-in size per block (``hardware.occupancy``), not the static one."""
        return self.shared_bytes > STATIC_SHARED_LIMIT


def _allocs(stmt, scopes: tuple) -> list:
    found = []
    tvm_ffi.structural_walk(stmt, (tirx.AllocBuffer, lambda a: found.append(a.buffer)
                                   if str(a.buffer.ty.storage_scope).startswith(scopes) else None))
    return found


def _padded_bytes(buf) -> int:
    """A buffer's bytes with its strides (dlight pads shared GEMM tiles against bank conflicts)."""
    ty = buf.ty
    strides = [int(s) for s in (getattr(ty, "strides", None) or []) if hasattr(s, "value") or isinstance(s, int)]
    shape = [int(d) for d in ty.shape]
    if strides and len(strides) == len(shape):
        return max(st * d for st, d in zip(strides, shape)) * tir_stats.dtype_bytes(ty.dtype)
    return tir_stats.buffer_bytes(buf)


def stage(body) -> Estimate:
    """One stage body (launch form, below its launch attributes)."""
    shared = sum(_padded_bytes(b) for b in _allocs(body, ("shared",)))
    words = sum(max(tir_stats.buffer_bytes(b) // 4, 1) for b in _allocs(body, ("local",)))
    regs = BASE_REGISTERS + words
    return Estimate(min(regs, MAX_REGISTERS), shared, regs > MAX_REGISTERS)


def kernel(stages: list[Estimate]) -> Estimate:
    """A stitched kernel of these stages: the worst stage, plus the stitching overhead."""
    regs = max(s.registers for s in stages) + (STITCH_REGISTERS if len(stages) > 1 else 0)
    return Estimate(min(regs, MAX_REGISTERS), max(s.shared_bytes for s in stages),
                    any(s.spills for s in stages) or regs > MAX_REGISTERS)
