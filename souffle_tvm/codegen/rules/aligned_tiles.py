"""AlignedTiles: an elementwise stage cut into the blocks its producer's tiles dictate."""

from __future__ import annotations

import math

from tvm import s_tir, tirx

from ...core.ir_names import ALIGNED_TILES_ATTR
from .base import CUDAScheduleRule


class AlignedTiles(CUDAScheduleRule):
    """A function without reductions whose ``ALIGNED_TILES_ATTR`` says how many blocks to use:
    its flattened outputs cut into that many equal contiguous tiles, a block each, one output
    per thread. ``stitch.joint_tiles`` sets the count where block ``b`` then reads only what its
    producer's block ``b`` wrote (an LSTM cell update after its gates' GEMV: four units a block,
    whose sixteen gates one GEMV block computes), so a stitched kernel puts a block barrier, not
    a grid sync, between them, and the tensor can stay in shared memory (``stitch.channel``)."""

    def __init__(self, block_size: int):
        self.block_size = block_size

    def apply(self, func: tirx.PrimFunc, target, tunable: bool) -> s_tir.Schedule | None:
        attrs = func.attrs if isinstance(func, tirx.PrimFunc) and func.attrs is not None else {}
        if ALIGNED_TILES_ATTR not in attrs:
            return None
        tiles = int(attrs[ALIGNED_TILES_ATTR])
        opened = self.root_blocks(func, target)
        if opened is None:
            return None
        sch, blocks = opened
        for b in blocks[:-1]:        # the stage's intermediate values computed where they are used
            try:
                sch.compute_inline(b)
            except s_tir.ScheduleError:
                return None
        (out,) = sch.get_child_blocks(sch.get_sblock("root"))
        if any(iv.iter_type != 0 for iv in sch.get(out).iter_vars):
            return None
        loops = sch.get_loops(out)
        points = math.prod(int(sch.get(lp).extent) for lp in loops)
        if tiles < 1 or points % tiles or points // tiles > self.block_size:
            return None
        bx, tx = sch.split(sch.fuse(*loops), [tiles, points // tiles])
        sch.bind(bx, "blockIdx.x")
        sch.bind(tx, "threadIdx.x")
        return sch
