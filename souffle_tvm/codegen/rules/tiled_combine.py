"""TiledCombine: the second phase of a two-phase reduction and its consumer, tiled like the GEMM."""

from __future__ import annotations

from tvm import s_tir, tirx

from ...core.geometry import STITCH_BLOCK
from ...core.ir_names import COMBINE_TILE_ATTR
from .base import CUDAScheduleRule


class TiledCombine(CUDAScheduleRule):
    """A combine group (``transforms.two_phase``: the per-row combines of the partials, then the
    row's consumer, softmax's normalisation or LayerNorm's) laid out like the GEMM whose output
    the consumer reads: block (x = row tile, y = the leading axes fused with the column tile),
    as ``PartialRows`` and the GEMM. Each thread combines the partials of its element's row in
    registers where it normalises the element (every column of a row does it again: a row has
    few partials, and no barrier or shared buffer is needed). Block ``vb`` then reads only the tile GEMM block ``vb`` wrote, so in a
    stitched kernel that tile can stay in the GEMM block's shared memory (``stitch.channel``)
    and the GEMM's output need not leave the chip.

    Applies to functions with blocks carrying one ``COMBINE_TILE_ATTR`` whose last block is the
    spatial consumer over ``[..., rows, columns]`` and whose other blocks inline into it."""

    def __init__(self, threads: int = STITCH_BLOCK):
        self.threads = threads

    def apply(self, func: tirx.PrimFunc, target, tunable: bool) -> s_tir.Schedule | None:
        opened = self.root_blocks(func, target)
        if opened is None:
            return None
        sch, blocks = opened
        names = [sch.get(b).name_hint for b in blocks]
        combines = [n for n, b in zip(names, blocks) if COMBINE_TILE_ATTR in sch.get(b).annotations]
        tiles = {int(sch.get(sch.get_sblock(n)).annotations[COMBINE_TILE_ATTR]) for n in combines}
        if len(tiles) != 1 or names[-1] in combines:
            return None
        code = tiles.pop()
        rows, cols = code // 65536, code % 65536
        out = sch.get_sblock(names[-1])
        if any(iv.iter_type != tirx.IterVar.DataPar for iv in sch.get(out).iter_vars):
            return None
        for n in names[:-1]:       # what lies between the combines and the consumer
            if n not in combines:
                sch.compute_inline(sch.get_sblock(n))
        *lead, r, c = sch.get_loops(out)
        extents = [int(sch.get(x).extent) for x in (r, c)]
        if extents[0] % rows or extents[1] % cols:
            return None
        ro, ri = sch.split(r, [None, rows])
        co, ci = sch.split(c, [None, cols])
        sch.reorder(ro, *lead, co, ri, ci)
        by = sch.fuse(*lead, co) if lead else co
        sch.bind(ro, "blockIdx.x")
        sch.bind(by, "blockIdx.y")
        _, tx = sch.split(sch.fuse(ri, ci), [None, self.threads])
        sch.bind(tx, "threadIdx.x")
        for n in reversed(combines):    # consumers first: each lands before what reads it
            b = sch.get_sblock(n)
            sch.set_scope(b, 0, "local")
            sch.compute_at(b, tx)
        return sch
