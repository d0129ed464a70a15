"""A block's cooperative copy of a GEMM operand's K slice into shared memory, its lanes along
the axis the operand is contiguous on in global memory.

dlight's SIMT GEMM stages each operand as ``[S, X, K]`` (X: the operand's rows or columns) and
fuses the copy's loops in that order, K innermost, split ``[threadIdx.y, threadIdx.x, serial,
vector]``. Two things then scatter a warp's request over sectors:

- an operand whose global layout is contiguous along X, not K (an ONNX MatMul's ``W[K, N]``, an
  NCHW convolution's input), gets lanes that each touch a different row: a sector per element;
- a slice larger than one vector per thread puts the serial loop inside the thread index, so
  consecutive lanes sit ``serial x vector`` elements apart (a 64-term K step: 64 bytes apart,
  a sector per lane for 8 bytes each).

Here the serial loop is outermost, so a warp's lanes take consecutive vectors, and an operand
contiguous along X is staged as ``[S, K, X]`` with X innermost: its copy then reads whole rows
of the source and stores whole rows of the slice, and the micro tile's reads of that operand
run along X too. An operand contiguous along K keeps dlight's layout and its row padding.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.sym import Analyzer


def fetch(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV, threads: tuple[int, int], vector: int,
          align: bool) -> None:
    """Lay out the copy ``block`` (a ``cache_read`` to shared memory under the K loop, its
    producers already inlined, its last three loops over ``[S, X, K]``): bound to the
    ``threads`` = (threadIdx.y, threadIdx.x) extents, vectorized by ``vector`` where the
    source's addresses allow, rows padded (dlight's ``storage_align``) if ``align`` and the
    layout stays dlight's."""
    s, x, k = sch.get_loops(block)[-3:]
    along_x = _contiguous_along(sch.get(block)) == 1
    if along_x:
        sch.transform_layout(block, ("write", 0), lambda v0, v1, v2: (v0, v2, v1))
        sch.reorder(k, x)
        if not _aligned(sch.get(block), vector):
            vector = 1
    fused = sch.fuse(s, k, x) if along_x else sch.fuse(s, x, k)
    _, ty, tx, vec = sch.split(fused, factors=[None, threads[0], threads[1], vector])
    sch.vectorize(vec)
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")
    if align and not along_x:
        sch.storage_align(block, 0, axis=1, factor=8, offset=vector)


def _global_loads(stmt) -> list[tvm.ir.TensorLoad]:
    loads = []
    tvm_ffi.structural_walk(stmt, (tvm.ir.TensorLoad, lambda ld: loads.append(ld)
                                   if str(ld.source.ty.storage_scope or "global") == "global" else None))
    return loads


def _uses(expr, var: tirx.Var) -> bool:
    found = []
    tvm_ffi.structural_walk(expr, (tirx.Var, lambda v: found.append(v) if v.same_as(var) else None))
    return bool(found)


def _at(expr, var: tirx.Var, value):
    return tvm_ffi.structural_map(expr, (tirx.Var, lambda v: value if v.same_as(var) else v))


def _contiguous_along(block: s_tir.SBlock) -> int | None:
    """Which of the copy's iteration axes (1: X, 2: K) every global load's innermost index
    moves with alone; None where the loads disagree or an index moves with both or neither."""
    iters = [iv.var for iv in block.iter_vars]
    axes = set()
    for load in _global_loads(block.body):
        moving = [a for a in (1, 2) if _uses(load.indices[-1], iters[a])]
        axes.add(moving[0] if len(moving) == 1 else None)
    return axes.pop() if len(axes) == 1 else None


def _aligned(block: s_tir.SBlock, vector: int) -> bool:
    """Whether a ``vector``-wide load along X, starting at an X that is a multiple of ``vector``,
    stays inside one aligned vector of every global source: its innermost index steps by one
    with X, sits at a multiple of ``vector`` there, and its rows are a multiple long."""
    if vector == 1:
        return True
    x = block.iter_vars[1].var
    analyzer = Analyzer()
    for load in _global_loads(block.body):
        shape = load.source.ty.shape
        if len(shape) > 1 and not (isinstance(shape[-1], tirx.IntImm) and int(shape[-1]) % vector == 0):
            return False
        index = load.indices[-1]
        step = analyzer.simplify(_at(index, x, x + 1) - index)
        start = analyzer.modular_set(_at(index, x, x * vector))
        if not (isinstance(step, tirx.IntImm) and int(step) == 1 and start.coeff % vector == 0
                and start.base % vector == 0):
            return False
    return True
