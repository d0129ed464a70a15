"""RowChain: a row chain (``te.chains``: attention) as one kernel whose rows never leave the chip."""

from __future__ import annotations

from tvm import s_tir, tirx

from ...cost import tir_stats
from ...core.geometry import STATIC_SHARED_LIMIT, STITCH_BLOCK
from ...te.rewrite import uses
from .base import CUDAScheduleRule

# rows a block holds, in order of preference: 16 rows of 16 lanes at 256 threads (two rows a
# warp; the combine adds 16 partials); 32 re-reads the tail's operand half as often, 8 pads least
ROW_TILES = (16, 32, 8)
STAGED_BYTES = 16 * 1024     # of the head's column operand in shared memory at a time


class RowChain(CUDAScheduleRule):
    """A group ``head → row stages → tail`` (``te.chains``; ``Q Kᵀ`` → softmax → ``P V``): one
    block per ``rows`` rows of the row space (a head's row block in attention) on one flat
    thread dimension, as a stitched kernel launches. The block computes its rows of the head
    whole (micro-tiles summed in registers, the head's column operand staged in shared memory,
    ``_micro_tile``), reduces each row in two steps (every one of ``threads / rows`` lanes a
    share into a shared partial, then one thread per row), normalises the rows and contracts
    them in the tail (micro-tiled too); the head's rows, the row partials and results and the
    tail's operand live in shared memory (element-wise stages between are recomputed where they
    are read), so only the chain's inputs and the tail's output touch global memory. ``rows``:
    of ``ROW_TILES`` whose shared tiles fit the static limit and whose lanes fit a warp, the one
    that computes the fewest rows past the end of the row axis, then the first in
    ``ROW_TILES``' order.

    Applies to a function whose first block is a contraction over ``[*rows, L]``, whose last
    block contracts ``[*rows, N]`` over ``L``, and whose blocks between are element-wise over
    ``[*rows, L]`` or reduce ``L`` to ``rows``."""

    def __init__(self, threads: int = STITCH_BLOCK):
        self.threads = threads

    def apply(self, func: tirx.PrimFunc, target, tunable: bool) -> s_tir.Schedule | None:
        opened = self.root_blocks(func, target)
        if opened is None:
            return None
        sch, blocks = opened
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
                and r * (full * length + len(kept)) * elem + STAGED_BYTES * 33 // 32 <= STATIC_SHARED_LIMIT]
        if not fits:
            return None
        # the fewest rows computed past the end of the row axis (49 rows: 7 blocks of 8), then by preference
        tile = min(fits, key=lambda r: (-(-rows[-1] // r) * r, ROW_TILES.index(r)))
        lanes = self.threads // tile
        for b, _ in middle:
            if b not in kept:
                sch.compute_inline(b)
        # Each row reduction in two steps: every lane sums its share of the row into a shared
        # partial (``rfactor``), then one lane per row adds the row's partials. A stitched
        # kernel launches one thread dimension, so a cross-thread reduction over the lanes of a
        # row alone (``tvm_thread_allreduce``) is not available to it.
        # A row's lanes: the most of ``lanes`` that divide the row. rfactor drops the predicate of
        # a ragged split, and the partials then summed past the row's end, into the next row's
        # scores (49-long rows over 32 lanes: wrong attention; tests/test_row_chain.py).
        shares = max(d for d in range(1, lanes + 1) if length % d == 0)
        parts = {}
        for b, (_, red) in middle:
            if b in kept and red:
                *_, kk = sch.get_loops(b)
                _, ki = sch.split(kk, [None, shares])
                parts[b] = sch.rfactor(ki, factor_axis=len(rows))
        tail = blocks[-1]
        *lead, r, n, k = sch.get_loops(tail)
        ro, ri = sch.split(r, [None, tile])
        sch.reorder(*lead, ro, ri, n, k)
        bx = sch.fuse(*lead, ro)
        sch.bind(bx, "blockIdx.x")
        _micro_tile(sch, tail, ri, n, k, tile, self.threads)
        on_chip = [blocks[0]] + [x for b in kept for x in ([parts[b]] if b in parts else []) + [b]]
        for b in reversed(on_chip):                # consumers first: each lands before what reads it
            sch.compute_at(b, bx, preserve_unit_loops=True)
            sch.set_scope(b, 0, "shared")
        # one thread dimension, as a stitched kernel launches: each stage maps the flat thread index
        for b in kept:
            if b in parts:
                # rfactor puts the lane axis first: the partial's loops are (lane, *rows, share),
                # the combine's (lane, *rows); thread t is share t % shares of row t // shares
                lp = sch.get_loops(parts[b])[-(len(rows) + 2):]
                sch.reorder(*lp[1:-2], lp[-2], lp[0])
                _, t = sch.split(sch.fuse(lp[-2], lp[0]), [None, self.threads])    # fewer shares: threads idle
                sch.bind(t, "threadIdx.x")
                # sums in registers, stored once: a barrier can go after, not inside, the loops
                sch.reverse_compute_at(sch.cache_write(parts[b], 0, "local"), t)
                lp = sch.get_loops(b)[-(len(rows) + 1):]
                sch.reorder(*lp[1:-1], lp[-1], lp[0])
                # thread t < tile combines row t's partials; the rest of the block waits
                _, t = sch.split(lp[-1], [None, self.threads])
                sch.bind(t, "threadIdx.x")
                sch.reverse_compute_at(sch.cache_write(b, 0, "local"), t)
                continue
            rr, cc = sch.get_loops(b)[-2:]         # rows, columns: consecutive threads, consecutive columns
            _, t = sch.split(sch.fuse(rr, cc), [None, self.threads])
            sch.bind(t, "threadIdx.x")
        head = blocks[0]
        rr, cc, kk = sch.get_loops(head)[-3:]
        col = [iv.var for iv in sch.get(head).iter_vars if iv.iter_type != tirx.IterVar.CommReduce][-1]
        staged = [i for i, r in enumerate(sch.get(head).reads)
                  if any(uses(x.min, [col]) for x in r.region)]
        # staged only where row blocks tile the rows exactly: under the guard of a ragged last
        # row block TVM cannot bound the operand's box to the block's own head
        stage = staged[0] if len(staged) == 1 and rows[-1] % tile == 0 else None
        acc = _written(sch, head)
        row_operand = [i for i, r in enumerate(sch.get(head).reads) if i not in staged and not r.source.same_as(acc)]
        held = row_operand[0] if stage is not None and len(row_operand) == 1 else None
        _micro_tile(sch, head, rr, cc, kk, tile, self.threads, stage, held)
        return sch


def _micro_tile(sch: s_tir.Schedule, block, rows, cols, summed, tile: int, threads: int,
                stage: int | None = None, held: int | None = None) -> None:
    """A contraction's ``tile`` x C block output over ``threads`` threads, each a micro-tile
    of ``m`` rows by a run of consecutive columns (``c`` threads across the columns), summed in registers (each operand element it loads
    serves ``m`` or C/``c`` products): ``m`` the largest of 4, 2, 1 whose ``c`` = threads x m /
    tile column lanes the columns can use. ``stage``: the operand (read index) whose rows the
    columns select is first copied to shared memory, ``STAGED_BYTES`` of it at a time (the
    columns in chunks), by all threads in coalesced rows, its rows padded one word apart so that
    lanes reading different rows hit different banks. ``held``: the operand (read index) whose
    rows are the block's own (attention's Q) is copied to shared memory once for the block: its
    ``tile`` rows are read again for every chunk of columns and by every micro-tile across them,
    from global memory a request per term and row."""
    extent = int(sch.get(cols).extent)
    m = next((m for m in (4, 2, 1) if tile % m == 0 and threads * m // tile <= extent), 1)
    lanes = threads * m // tile
    outer = []
    if stage is not None:
        per_col = int(sch.get(summed).extent) * tir_stats.dtype_bytes(str(sch.get(block).reads[stage].source.ty.dtype))
        chunk = max(lanes, STAGED_BYTES // per_col // lanes * lanes)
        if chunk < extent:
            outer, cols = sch.split(cols, [None, chunk])
            outer = [outer]
    rt, rm = sch.split(rows, [tile // m, m])
    # a thread's columns consecutive: the box its registers are stored back from is exact
    ci, co = sch.split(cols, [lanes, None])
    sch.reorder(*outer, rt, ci, summed, co, rm)
    t = sch.fuse(rt, ci)
    sch.bind(t, "threadIdx.x")
    sch.reverse_compute_at(sch.cache_write(block, 0, "local"), t)
    if stage is not None:
        src = sch.get(block).reads[stage].source
        around = sch.get_loops(block)
        depth = next(i for i, lp in enumerate(around) if sch.get(lp).same_as(sch.get(outer[0]))) + 1 if outer else 1
        copy = sch.cache_read(block, stage, "shared")
        sch.compute_at(copy, around[depth - 1])
        loops = sch.get_loops(copy)[depth:]
        _, tc = sch.split(sch.fuse(*loops), [None, threads])
        sch.bind(tc, "threadIdx.x")
        elem = tir_stats.dtype_bytes(str(src.ty.dtype))
        sch.storage_align(copy, 0, axis=len(src.ty.shape) - 2, factor=32, offset=max(1, 4 // elem))
    if held is not None:
        src = sch.get(block).reads[held].source
        # this block's reads only: the tail reads V out of the same fused QKV tensor
        copy = sch.cache_read(block, held, "shared", consumer_blocks=[block])
        sch.compute_at(copy, sch.get_loops(block)[0])
        _, tc = sch.split(sch.fuse(*sch.get_loops(copy)[1:]), [None, threads])
        sch.bind(tc, "threadIdx.x")
        elem = tir_stats.dtype_bytes(str(src.ty.dtype))
        sch.storage_align(copy, 0, axis=len(src.ty.shape) - 2, factor=32, offset=max(1, 4 // elem))
    # each term's operand elements into registers once per term: inside the micro-tile's loops a
    # load that does not depend on one of them (Q's row element across a thread's columns, V's
    # across its rows) would be issued again for every iteration of it
    acc = sch.get(block).writes[0].source
    for i in [i for i, r in enumerate(sch.get(block).reads) if not r.source.same_as(acc)]:
        sch.compute_at(sch.cache_read(block, i, "local", consumer_blocks=[block]), summed)


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
