"""NothingToWrite: a function whose every store goes to an empty tensor runs nothing."""

from __future__ import annotations

import tvm_ffi
from tvm import s_tir, tirx

from ...core.root_block import with_root_block
from .base import CUDAScheduleRule


class NothingToWrite(CUDAScheduleRule):
    """Every buffer the function stores to has a dimension of extent 0 (an empty slice: the
    present state of a causal convolution of kernel size 1). Its loops run zero times, and
    dlight's rules divide by those extents (TVM's own CUDA build fails in ``Fallback`` with
    "Divide by zero"). The schedule is the function with nothing in it: no kernel is launched."""

    def apply(self, func: tirx.PrimFunc, target, tunable: bool) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        stores = []
        tvm_ffi.structural_walk(func.body, (tirx.BufferStore, lambda s: stores.append(s.buffer)))
        empty = [any(isinstance(e, tirx.IntImm) and int(e) == 0 for e in b.ty.shape) for b in stores]
        if not stores or not all(empty):
            return None
        return s_tir.Schedule(with_root_block(tirx.PrimFunc(func.params, tirx.Evaluate(0), attrs=func.attrs)))
