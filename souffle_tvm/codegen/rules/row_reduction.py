"""RowReduction: dlight's ``GeneralReduction`` (LayerNorm, softmax, RMSNorm: a block per row) at a
stitched kernel's block size."""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir import dlight as dl
from tvm.s_tir.schedule import Instruction, Trace

from .base import CUDAScheduleRule

# the threads per row dlight's GeneralReduction fixes on CUDA, inside its ``apply``
DLIGHT_THREADS = 256


class RowReduction(CUDAScheduleRule, dl.gpu.GeneralReduction):
    """dlight's ``GeneralReduction`` with ``threads`` per row (reported as "GeneralReduction").
    dlight fixes 256 threads on CUDA; at another size its schedule's trace is replayed with
    the thread splits (the ``Split`` steps whose inner factor is those 256) resized: the same
    steps, the same schedule, ``threads`` wide."""

    def __init__(self, threads: int = DLIGHT_THREADS):
        super().__init__()
        self.threads = threads

    def apply(self, func: tirx.PrimFunc, target, tunable: bool) -> s_tir.Schedule | None:
        sch = super().apply(func, target, tunable)
        if sch is None or isinstance(sch, list) or self.threads == DLIGHT_THREADS:
            return sch
        steps = [_resized(inst, self.threads) if inst.kind.name == "Split" else inst for inst in sch.trace.insts]
        out = s_tir.Schedule(func)
        Trace(steps, {}).apply_to_schedule(out, remove_postproc=False)
        return out


def _resized(split: Instruction, threads: int) -> Instruction:
    """A ``Split`` whose inner factor is dlight's thread count, with ``threads`` instead."""
    *outer, inner = split.inputs[1:]
    if not (isinstance(inner, tirx.IntImm) and inner.value == DLIGHT_THREADS):
        return split
    return Instruction(split.kind, [split.inputs[0], *outer, tirx.IntImm(str(inner.ty.dtype), threads)],
                       split.attrs, split.outputs)
