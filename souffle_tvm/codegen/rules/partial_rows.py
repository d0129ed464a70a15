"""PartialRows: the first phase of a two-phase reduction, tiled like the GEMM that feeds it."""

from __future__ import annotations

from tvm import s_tir, tirx

from ...core.ir_names import ATOMIC_ATTR, LANES_ATTR, ROW_TILE_ATTR, TILE_ATTR
from .base import CUDAScheduleRule


class PartialRows(CUDAScheduleRule):
    """The first phase of a two-phase reduction (``transforms.two_phase``), laid out like the
    GEMM that feeds it: block (x = row tile, y = the leading axes fused with the column tile),
    ``LANES_ATTR`` threads per row of the tile (``ROW_TILE_ATTR`` rows; thread ``t`` is lane
    ``t % lanes`` of row ``t // lanes``), each lane its every ``lanes``-th column reduced
    serially into its own partial (neighbouring lanes read neighbouring columns). Each block then
    reads exactly the tile the same-numbered GEMM block wrote, which the stitcher can prove.

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
