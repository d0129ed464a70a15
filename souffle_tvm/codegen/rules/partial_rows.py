"""PartialRows: the first phase of a two-phase reduction, tiled like the GEMM that feeds it."""

from __future__ import annotations

from tvm import s_tir, tirx

from ...core.ir_names import ATOMIC_ATTR, ROW_TILE_ATTR, TILE_ATTR
from .base import CUDAScheduleRule


class PartialRows(CUDAScheduleRule):
    """The first phase of a two-phase reduction (``transforms.two_phase``), laid out like the
    GEMM that feeds it: block (x = row tile, y = the leading axes fused with the column tile),
    one thread per row of the tile (``ROW_TILE_ATTR``), the tile's columns reduced serially. Each block then reads
    exactly the tile the same-numbered GEMM block wrote, which the stitcher can prove.

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
        rows_per_tile = int(sch.get(blocks[0]).annotations.get(ROW_TILE_ATTR, tiles.pop()))
        *lead, rows, col, red = sch.get_loops(blocks[0])
        ro, ri = sch.split(rows, [None, rows_per_tile])
        sch.reorder(ro, *lead, col, ri, red)
        by = sch.fuse(*lead, col) if lead else col
        sch.bind(ro, "blockIdx.x")
        sch.bind(by, "blockIdx.y")
        sch.bind(ri, "threadIdx.x")
        for b in blocks[1:]:     # later partials of the same rows: same threads, same loop
            sch.reverse_compute_at(b, ri)
        return sch
