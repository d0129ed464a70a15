"""PartialRows: the first phase of a two-phase reduction, tiled like the GEMM that feeds it."""

from __future__ import annotations

import tvm_ffi
from tvm import s_tir, tirx

from ...te.rewrite import uses
from ...core.ir_names import ATOMIC_ATTR, LANES_ATTR, ROW_TILE_ATTR, TILE_ATTR
from .base import CUDAScheduleRule


class PartialRows(CUDAScheduleRule):
    """The first phase of a two-phase reduction (``transforms.two_phase``), laid out like the
    GEMM that feeds it: block (x = row tile, y = the leading axes fused with the column tile),
    ``LANES_ATTR`` threads per row of the tile (``ROW_TILE_ATTR`` rows; thread ``t`` is lane
    ``t % lanes`` of row ``t // lanes``), each lane its every ``lanes``-th column reduced
    serially (neighbouring lanes read neighbouring columns), the lanes' sums then added on chip
    (``_with_lanes``); with one lane, a thread a row. Each block then reads exactly the tile the
    same-numbered GEMM block wrote, which the stitcher can prove.

    Applies to functions whose blocks all carry the same ``TILE_ATTR`` and none ``ATOMIC_ATTR``
    (those are ``AtomicRows``')."""

    def apply(self, func: tirx.PrimFunc, target, tunable: bool) -> s_tir.Schedule | None:
        opened = self.root_blocks(func, target)
        if opened is None:
            return None
        sch, blocks = opened
        tiles = {int(sch.get(b).annotations.get(TILE_ATTR, 0)) for b in blocks}
        if len(tiles) != 1 or 0 in tiles or any(ATOMIC_ATTR in sch.get(b).annotations for b in blocks):
            return None
        tile = tiles.pop()
        shapes = {(int(sch.get(b).annotations.get(ROW_TILE_ATTR, tile)), int(sch.get(b).annotations.get(LANES_ATTR, 1)))
                  for b in blocks}
        if len(shapes) != 1:      # partials of different tiles: not one layout
            return None
        ((rows_per_tile, lanes),) = shapes
        if lanes > 1:
            return _with_lanes(sch, blocks, rows_per_tile, lanes)
        *lead, rows, col, red = sch.get_loops(blocks[0])
        ro, ri = sch.split(rows, [None, rows_per_tile])
        co, ci = sch.split(col, [None, lanes])
        sch.reorder(ro, *lead, co, ri, ci, red)
        by = sch.fuse(*lead, co) if lead else co
        sch.bind(ro, "blockIdx.x")
        sch.bind(by, "blockIdx.y")
        tx = sch.fuse(ri, ci)
        sch.bind(tx, "threadIdx.x")
        for b in blocks[1:]:     # later partials of the same rows: same threads, same loop
            sch.reverse_compute_at(b, tx)
        return sch


def _with_lanes(sch: s_tir.Schedule, blocks: list, rows_per_tile: int, lanes: int) -> s_tir.Schedule:
    """Each partial of a tile row summed by ``lanes`` threads (threadIdx.x; the row is threadIdx.y),
    lane ``l`` over the columns ``l + lanes * i`` (``rfactor`` into shared memory), then the lanes'
    sums added per row from shared memory, as ``ColumnReduction``'s write-back does: every lane of
    the row adds them in its own register and stores the same value, so only the tile's partial
    leaves the chip. A later partial of the same rows (the sum of squares about the tile's mean,
    the exponentials' sum under the tile's maximum) reads the earlier one's value behind it."""
    pairs = []
    for b in blocks:
        *_, red = sch.get_loops(b)
        _, kl = sch.split(red, [None, lanes])
        pairs.append((sch.rfactor(kl, 0), b))
    by = None
    for rf, wb in pairs:
        if by is None:
            *lead, rows, col, ki, kl = sch.get_loops(rf)      # kl: the lane, rfactor's spatial axis
            ro, ri = sch.split(rows, [None, rows_per_tile])
            sch.reorder(ro, *lead, col, ri, kl, ki)
            by = sch.fuse(*lead, col) if lead else col
            sch.bind(ro, "blockIdx.x")
            sch.bind(by, "blockIdx.y")
        else:
            sch.reverse_compute_at(rf, by, preserve_unit_loops=True)
            feeds = _feeds(sch, rf)
            kl = feeds[0]                      # rfactor's lane axis is the block's first
            ki = next(lp for i, lp in feeds.items() if sch.get(rf).iter_vars[i].iter_type == 2)
            ri = next(lp for i, lp in feeds.items() if lp not in (kl, ki) and int(sch.get(lp).extent) > 1)
            sch.reorder(ri, kl, ki)
        sch.bind(ri, "threadIdx.y")
        sch.bind(kl, "threadIdx.x")
        # The lanes accumulate in shared memory, so ThreadSync puts a barrier in every step of
        # their loop. Those barriers also order a later partial's reads of an earlier one (m2 of
        # s: each lane reads the value every lane of its row stored): summed in registers
        # instead, the race checker caught that read unordered (tests/test_two_phase.py).
        sch.set_scope(rf, 0, "shared")
        sch.decompose_reduction(rf, ki)
        store = sch.cache_write(wb, 0, "local")
        sch.reverse_compute_at(wb, by, preserve_unit_loops=True)
        row, lane = _row_and_lane(sch, wb)
        sch.reorder(row, lane)
        sch.bind(row, "threadIdx.y")
        sch.reverse_compute_at(store, row)       # after the lanes' sum: one store of the whole
    return sch


def _row_and_lane(sch: s_tir.Schedule, wb) -> tuple:
    """The write-back's loop over the tile's rows (the spatial one longer than 1) and its loop
    over the summed lanes."""
    feeds = _feeds(sch, wb)
    kinds = sch.get(wb).iter_vars
    lane = next(lp for i, lp in feeds.items() if kinds[i].iter_type == 2)
    row = next(lp for i, lp in feeds.items() if kinds[i].iter_type == 0 and int(sch.get(lp).extent) > 1)
    return row, lane


def _feeds(sch: s_tir.Schedule, block_rv) -> dict:
    """Per iterator of the block (its position), the innermost loop whose variable its binding uses."""
    out = {}
    values = _iter_values(sch, block_rv)
    for lp in sch.get_loops(block_rv):
        var = sch.get(lp).loop_var
        for i, v in enumerate(values):
            if uses(v, [var]):
                out[i] = lp
    return out


def _iter_values(sch: s_tir.Schedule, block_rv) -> list:
    parent = sch.get_sref(sch.get_loops(block_rv)[-1]).stmt
    found = []
    tvm_ffi.structural_walk(parent.body, (s_tir.SBlockRealize, lambda r: found.append(r)
                                          if r.block.same_as(sch.get(block_rv)) else None))
    return list(found[0].iter_values)

