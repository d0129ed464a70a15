"""RowChain: a row chain (``te.chains``: attention) as one kernel whose rows never leave the chip."""

from __future__ import annotations

from tvm import s_tir, tirx

from ...core import tir_stats
from ...core.geometry import STATIC_SHARED_LIMIT, STITCH_BLOCK
from .base import CUDAScheduleRule

ROW_TILES = (32, 16, 8)     # rows a block holds, largest first


class RowChain(CUDAScheduleRule):
    """A group ``head → row stages → tail`` (``te.chains``; ``Q Kᵀ`` → softmax → ``P V``): one
    block per ``rows`` rows of the row space (a head's row block in attention), ``threads`` as
    ``rows`` x ``lanes``. The block computes its rows of the head whole (each lane a strided
    share of the columns, accumulated in a register), reduces them with a cross-lane reduction
    per row, normalises them, and contracts them in the tail; the head's rows, each row
    reduction and the tail's operand live in shared memory (element-wise stages between are
    recomputed where they are read), so only the chain's inputs and the tail's output touch
    global memory. ``rows``: of ``ROW_TILES`` whose shared tiles fit the static limit and whose
    lanes fit a warp, the one that computes the fewest rows past the end of the row axis, then
    the largest.

    Applies to a function whose first block is a contraction over ``[*rows, L]``, whose last
    block contracts ``[*rows, N]`` over ``L``, and whose blocks between are element-wise over
    ``[*rows, L]`` or reduce ``L`` to ``rows``."""

    def __init__(self, threads: int = STITCH_BLOCK):
        self.threads = threads

    def apply(self, func: tirx.PrimFunc, target, tunable: bool) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        sch = s_tir.Schedule(func)
        blocks = sch.get_child_blocks(sch.get_sblock("root"))
        shapes = [_shape(sch, b) for b in blocks]
        if len(blocks) < 3 or any(s is None for s in shapes):
            return None
        (head_sp, head_red), (tail_sp, tail_red) = shapes[0], shapes[-1]
        if not head_red or len(head_sp) < 2 or len(tail_red) != 1:
            return None
        rows, length = head_sp[:-1], head_sp[-1]
        if tail_sp[:-1] != rows or tail_red != [length] or len(tail_sp) != len(rows) + 1:
            return None
        middle = list(zip(blocks[1:-1], shapes[1:-1]))
        if not any(red for _, (_, red) in middle):
            return None
        for _, (sp, red) in middle:
            if not (sp == head_sp and not red or sp == rows and red == [length]):
                return None
        read_by_tail = {r.source for r in sch.get(blocks[-1]).reads}
        kept = [b for b, (_, red) in middle if red or _written(sch, b) in read_by_tail]
        full = 1 + sum(1 for b, (_, red) in middle if b in kept and not red)
        elem = _elem_bytes(sch, blocks[0])
        fits = [r for r in ROW_TILES if r <= rows[-1] and self.threads % r == 0 and self.threads // r <= 32
                and r * (full * length + len(kept)) * elem <= STATIC_SHARED_LIMIT]
        if not fits:
            return None
        # the fewest rows computed past the end of a row block (49 rows: 7 blocks of 8), then the largest
        tile = min(fits, key=lambda r: (-(-rows[-1] // r) * r, -r))
        lanes = self.threads // tile
        for b, _ in middle:
            if b not in kept:
                sch.compute_inline(b)
        # Each row reduction in two steps: every lane sums its share of the row into a shared
        # partial (``rfactor``), then one lane per row adds the row's partials. A stitched
        # kernel launches one thread dimension, so a cross-thread reduction over the lanes of a
        # row alone (``tvm_thread_allreduce``) is not available to it.
        parts = {}
        for b, (_, red) in middle:
            if b in kept and red:
                *_, kk = sch.get_loops(b)
                _, ki = sch.split(kk, [None, lanes])
                parts[b] = sch.rfactor(ki, factor_axis=len(rows))
        tail = blocks[-1]
        *lead, r, n, k = sch.get_loops(tail)
        ro, ri = sch.split(r, [None, tile])
        no, ni = sch.split(n, [None, lanes])
        sch.reorder(*lead, ro, ri, ni, no, k)
        bx = sch.fuse(*lead, ro)
        sch.bind(bx, "blockIdx.x")
        sch.bind(ri, "threadIdx.y")
        sch.bind(ni, "threadIdx.x")
        acc = sch.cache_write(tail, 0, "local")
        sch.reverse_compute_at(acc, no)
        on_chip = [blocks[0]] + [x for b in kept for x in ([parts[b]] if b in parts else []) + [b]]
        for b in reversed(on_chip):                # consumers first: each lands before what reads it
            sch.compute_at(b, bx, preserve_unit_loops=True)
            sch.set_scope(b, 0, "shared")
        for b in kept:
            if b in parts:
                # rfactor puts the lane axis first: the partial's loops are (lane, *rows, share),
                # the combine's (lane, *rows)
                lp = sch.get_loops(parts[b])[-(len(rows) + 2):]
                sch.reorder(lp[-2], lp[0])
                sch.bind(lp[-2], "threadIdx.y")
                sch.bind(lp[0], "threadIdx.x")
                # sums in registers, stored once: a barrier can go after, not inside, the loops
                sch.reverse_compute_at(sch.cache_write(parts[b], 0, "local"), lp[0])
                lp = sch.get_loops(b)[-(len(rows) + 1):]
                sch.reorder(lp[-1], lp[0])
                # thread t < tile combines row t's partials; the rest of the block waits
                _, flat = sch.split(lp[-1], [None, tile * lanes])
                ty, tx = sch.split(flat, [tile, lanes])
                sch.bind(ty, "threadIdx.y")
                sch.bind(tx, "threadIdx.x")
                sch.reverse_compute_at(sch.cache_write(b, 0, "local"), tx)
                continue
            rr, cc = sch.get_loops(b)[-2:]         # rows, columns
            co, ci = sch.split(cc, [None, lanes])
            sch.reorder(rr, ci, co)
            sch.bind(rr, "threadIdx.y")
            sch.bind(ci, "threadIdx.x")
        head = blocks[0]
        rr, cc, kk = sch.get_loops(head)[-3:]
        co, ci = sch.split(cc, [None, lanes])
        sch.reorder(rr, ci, co, kk)
        sch.bind(rr, "threadIdx.y")
        sch.bind(ci, "threadIdx.x")
        acc = sch.cache_write(head, 0, "local")
        sch.reverse_compute_at(acc, co)
        return sch


def _shape(sch: s_tir.Schedule, block) -> tuple[list[int], list[int]] | None:
    """(spatial extents, summed extents) of a block, or None where an extent is not constant."""
    sp, red = [], []
    for iv in sch.get(block).iter_vars:
        ext = iv.dom.extent
        if not isinstance(ext, tirx.IntImm):
            return None
        (red if iv.iter_type == tirx.IterVar.CommReduce else sp).append(int(ext))
    return sp, red


def _written(sch: s_tir.Schedule, block):
    return sch.get(block).writes[0].source


def _elem_bytes(sch: s_tir.Schedule, block) -> int:
    return tir_stats.dtype_bytes(str(_written(sch, block).ty.dtype))
