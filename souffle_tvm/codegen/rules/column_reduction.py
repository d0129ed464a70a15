"""ColumnReduction: a reduction over an outer axis, K split over threadIdx.y (stitched stages)."""

from __future__ import annotations

import math

from tvm import s_tir, tirx

from ...te.rewrite import variables
from .base import CUDAScheduleRule


class ColumnReduction(CUDAScheduleRule):
    """A reduction over an outer axis: x·W with W laid out [K, N] (the LSTM's recurrent GEMV,
    MMoE's experts at batch 1), which dlight's GEMV and Reduction rules leave to the Fallback
    at 256 threads: one output per thread, a serial loop over K, N / 256 blocks.

    Here each block makes ``tx`` outputs across threadIdx.x, reading W's rows coalesced, and
    splits K ``ty`` ways over threadIdx.y (``rfactor`` into shared memory), the partial sums
    then added per output: ``tx * ty`` = the stitched block size, N / ``tx`` blocks. dlight's
    Reduction rule does the same for its "inner spatial" case with its own thread counts."""

    TX = (16, 32, 8, 64, 4)     # outputs per block, dlight's first; K is split block size / tx ways

    def __init__(self, block_size: int):
        self.block_size = block_size

    def apply(self, func: tirx.PrimFunc, target, tunable: bool) -> s_tir.Schedule | None:
        opened = self.root_blocks(func, target)
        if opened is None:
            return None
        sch, blocks = opened
        if len(blocks) != 1:
            return None
        block = sch.get(blocks[0])
        spatial = [iv for iv in block.iter_vars if iv.iter_type == 0]
        reduce = [iv for iv in block.iter_vars if iv.iter_type == 2]
        if len(reduce) != 1 or not spatial or len(block.iter_vars) != len(spatial) + 1 or len(block.writes) != 1:
            return None
        # the column case: the largest input is indexed by the reduction axis, and innermost by a
        # spatial one (an inner reduction is dlight's, at any thread count)
        big = max(block.reads, key=lambda r: math.prod(int(d) for d in r.source.ty.shape))
        inner = variables(big.region[-1].min)
        if not any(v.same_as(reduce[0].var) for r in big.region for v in variables(r.min)) or \
                not inner or any(v.same_as(reduce[0].var) for v in inner):
            return None
        loops = sch.get_loops(blocks[0])
        if len(loops) != len(block.iter_vars):
            return None
        points = math.prod(int(iv.dom.extent) for iv in spatial)
        k = int(reduce[0].dom.extent)
        shape = next(((tx, self.block_size // tx) for tx in self.TX if points % tx == 0
                      and k % (self.block_size // tx) == 0), None)
        if shape is None:
            return None
        tx_n, ty_n = shape
        if not _trivially_bound(func, [sch.get(lp).loop_var for lp in loops]):
            return None
        s_loops = [lp for lp, iv in zip(loops, block.iter_vars) if iv.iter_type == 0]
        r_loops = [lp for lp, iv in zip(loops, block.iter_vars) if iv.iter_type == 2]
        sch.reorder(*s_loops, r_loops[0])
        fused = sch.fuse(*s_loops)
        sch.split(fused, [None, tx_n])
        _, ty = sch.split(r_loops[0], [None, ty_n])
        rf = sch.rfactor(ty, 0)
        bx, tx, ro, ty, *_ = sch.get_loops(rf)
        sch.reorder(bx, tx, ty, ro)
        sch.bind(bx, "blockIdx.x")
        sch.bind(tx, "threadIdx.x")
        sch.bind(ty, "threadIdx.y")
        sch.set_scope(rf, 0, "shared")
        sch.decompose_reduction(rf, ro)
        # The write-back sums each output's ty partials from shared memory in a serial loop (a
        # cross-thread reduction over threadIdx.y does not lower here: docs/tvm-workarounds.md).
        # Every threadIdx.y row does the same sums, each in its own register, and stores the
        # same value: no race.
        store = sch.cache_write(blocks[0], 0, "local")
        sch.reverse_compute_at(blocks[0], bx, preserve_unit_loops=True)
        _, r, *s_rest = sch.get_loops(blocks[0])
        s_wb = sch.fuse(*s_rest) if len(s_rest) > 1 else s_rest[0]
        sch.reorder(s_wb, r)
        sch.bind(s_wb, "threadIdx.x")
        sch.reverse_compute_at(store, s_wb)
        return sch


def _trivially_bound(func: tirx.PrimFunc, loop_vars: list) -> bool:
    """Is the (only) block's i-th iterator the i-th loop's variable (TE's form)?"""
    import tvm_ffi

    realizes: list = []
    tvm_ffi.structural_walk(func.body, (s_tir.SBlockRealize, lambda r: realizes.append(r)))
    values = [r for r in realizes if r.block.name_hint != "root"]
    return len(values) == 1 and len(values[0].iter_values) == len(loop_vars) and \
        all(isinstance(v, tirx.Var) and v.same_as(lv) for v, lv in zip(values[0].iter_values, loop_vars))
