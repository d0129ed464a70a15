"""SerialReduction: many outputs of a few terms each, one output per thread (stitched stages)."""

from __future__ import annotations

import math

import tvm_ffi
from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.s_tir.dlight.base import try_inline

from ...cost import tir_stats
from .base import CUDAScheduleRule
from .gemm_tiles import ContractionWork, stitched_seconds


class SerialReduction(CUDAScheduleRule):
    """A reduction whose outputs are many and whose terms per output are few: a depthwise or
    grouped convolution (EfficientNet's 3 x 3 depthwise: 401,408 outputs of 9 terms; ResNeXt's
    grouped 3 x 3 over 8-64 channels). dlight's ``GeneralReduction`` gives each output a block
    whose threads split its terms, so most threads idle and the blocks run in hundreds of
    waves. Here each thread makes one output, summing its terms serially (dlight's ``Fallback``
    form) and applying the epilogue, where the latency model predicts that faster on a stitched kernel's resident blocks:
    ``ceil(outputs / threads)`` blocks against one block per output. A row reduction of few
    long rows (LayerNorm, softmax) keeps the cross-thread form, which the model predicts faster
    there."""

    def __init__(self, block_size: int):
        self.block_size = block_size

    def apply(self, func: tirx.PrimFunc, target, tunable: bool) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        shape = _reduction_shape(func)
        if shape is None:
            return None
        outputs, _ = shape
        _, flops, nbytes, _ = tir_stats.heaviest_block(func)
        # both forms read each term once per output (no operand tile to re-read: nothing written
        # counted), so the choice is the same with or without an epilogue in the group
        work = ContractionWork(flops, nbytes, 0, 4)

        def seconds(tiles: int) -> float:
            return stitched_seconds(work, tiles, self.block_size, False, target)

        if seconds(-(-outputs // self.block_size)) >= seconds(outputs):
            return None
        return _one_output_per_thread(func, self.block_size)


def _one_output_per_thread(func: tirx.PrimFunc, threads: int) -> s_tir.Schedule | None:
    """dlight's ``Fallback`` form of the reduction (spatial loops fused over blocks x threads,
    its terms serial in the thread), with what follows it computed in the same thread: Fallback
    would bind an epilogue it cannot inline (swish reads the sum twice) as a second launch
    region, its input a round trip through global memory. None where the group is not one
    reduction and elementwise consumers."""
    sch = s_tir.Schedule(func)
    infos = normalize_prim_func(sch)
    if infos is None:
        return None
    infos = try_inline(sch, infos)
    kinds = [info.is_reduction() for info in infos]
    if kinds.count(True) != 1 or not kinds[0]:
        return None      # a producer left un-inlined, or several reductions: not this form
    block = infos[0].block_rv
    s_loops, r_loops = [], []
    for loop, kind in zip(sch.get_loops(block), infos[0].dom_kind()):
        (r_loops if kind == "R" else s_loops).append(loop)
    if not s_loops or len(s_loops) + len(r_loops) != len(sch.get_loops(block)):
        return None
    sch.reorder(*s_loops, *r_loops)
    bx, tx = sch.split(sch.fuse(*s_loops), factors=[None, threads])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    try:
        for info in reversed(infos[1:]):
            sch.reverse_compute_at(info.block_rv, tx)
    except (RuntimeError, ValueError):    # tvm's ScheduleError: a consumer that is not elementwise
        return None
    # Each sum (every value of a tuple reduction: argmin's index and value) stays in its thread's
    # registers unless it is the group's output; left in an allocated global buffer, CUDA
    # codegen refuses the kernel ("Cannot allocate global memory").
    params = list(func.params)
    for i, w in enumerate(sch.get(block).writes):
        if not any(w.source.same_as(p) for p in params):
            sch.set_scope(block, i, "local")
    sch.decompose_reduction(block, r_loops[0])
    return sch


def _reduction_shape(func: tirx.PrimFunc) -> tuple[int, int] | None:
    """(outputs, terms per output) of ``func``'s largest reduction block (by outputs x terms);
    None where it has none or its extents are not constants."""
    best = None

    def visit(blk):
        nonlocal best
        spatial = [iv.dom.extent for iv in blk.iter_vars if iv.iter_type == tirx.IterVar.DataPar]
        terms = [iv.dom.extent for iv in blk.iter_vars if iv.iter_type == tirx.IterVar.CommReduce]
        if not terms or not all(isinstance(e, tirx.IntImm) for e in spatial + terms):
            return
        shape = (math.prod(int(e) for e in spatial), math.prod(int(e) for e in terms))
        if best is None or shape[0] * shape[1] > best[0] * best[1]:
            best = shape

    tvm_ffi.structural_walk(func.body, (s_tir.SBlock, visit))
    return best
