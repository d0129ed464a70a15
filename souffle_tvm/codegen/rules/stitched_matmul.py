"""StitchedMatmul: dlight's GEMM schedule at a stitched kernel's block size (reported as
"Matmul"), its tile sized to the kernel's grid."""

from __future__ import annotations

import math

import tvm
from tvm import s_tir, tirx
from tvm.s_tir import dlight as dl

from ...core import tir_stats
from ...core.geometry import (MATMUL_K_TILE, MATMUL_MICRO, MATMUL_MICROS, MATMUL_THREAD_GRIDS, STATIC_SHARED_LIMIT,
                              STITCH_BLOCK)
from ...core.ir_names import GEMM_TILE_ATTR
from .base import CUDAScheduleRule
from .gemm_tiles import ContractionWork, SimtTile, block_count, contraction_extents, stitched_seconds, tile_count


class StitchedMatmul(CUDAScheduleRule, dl.gpu.Matmul):
    """dlight's GEMM schedule with the thread grid of a stitched kernel's block
    (``MATMUL_THREAD_GRIDS``: 16 x 16 at 256 threads; dlight's own CUDA choice is 8 x 16) and a
    chosen K tile. Tiles past the 48 KB a kernel may declare statically go to dynamic shared
    memory (``shared.dyn``), which TVM's runtime opts in for at launch.

    The stage geometry: each thread computes ``micro x micro`` outputs, so at 256 threads a
    block's tile is 64, 32 or 16 wide. Unless ``micro`` is given, the rule prices each and
    keeps the one the latency model predicts fastest on ``slots`` resident blocks (default: a
    stitched kernel's, ``STITCH_BLOCKS_PER_SM`` per SM): a GEMM whose large tiles leave most of
    the grid idle takes smaller tiles that fill it, one whose tiles already fill whole waves
    keeps the operand reuse of the large tile. The choice reads only the GEMM's contraction
    (its heaviest block), so a GEMM gets the same tile with or without a fused epilogue, the
    tile a two-phase partial shares (``GEMM_TILE_ATTR`` on the schedule says which).

    (``import tvm`` already imports dlight, so subclassing it here costs no import time.)"""

    def __init__(self, k_tile: int = MATMUL_K_TILE, micro: int | None = None, slots: int | None = None,
                 threads: int = STITCH_BLOCK):
        super().__init__()
        if threads not in MATMUL_THREAD_GRIDS:
            raise ValueError(f"a stitched GEMM has {' or '.join(map(str, MATMUL_THREAD_GRIDS))} threads "
                             f"(asked: {threads})")
        self.k_tile, self.micro, self.slots = k_tile, micro, slots
        self.grid = MATMUL_THREAD_GRIDS[threads]
        self._micro = micro or MATMUL_MICRO     # what get_configs hands dlight

    @property
    def threads(self) -> int:
        return self.grid[0] * self.grid[1]

    def tile(self, micro: int) -> tuple[int, int]:
        """The (rows, columns) of output a block computes with ``micro x micro`` per thread."""
        return self.grid[0] * micro, self.grid[1] * micro

    def get_configs(self, target):
        config = super().get_configs(target)
        config.block_size_x, config.block_size_y = self.grid     # dlight's x: the rows (inner_x=False)
        config.micro_size_x = config.micro_size_y = self._micro
        config.vthread_x = config.vthread_y = 1
        config.micro_size_k = self.k_tile
        return config

    def apply(self, func, target, tunable):
        if self.micro is not None:
            return self._apply(func, target, self.micro)
        # (repeats are not scheduled again: pipeline.policies keeps the default rules' schedules
        # across compiles, and each GEMM's tile for the two-phase pass)
        extents = contraction_extents(func)
        if extents == ():
            return None       # dlight's GEMM rule finds no contraction here either
        if extents is not None:
            work = ContractionWork.of(func)
            counts = {m: tile_count(extents, *self.tile(m)) for m in MATMUL_MICROS}
            # The tile count of each side is known before scheduling: schedule only the winner,
            # and search as below if its schedule has another count than predicted.
            seconds = {m: stitched_seconds(work, counts[m], self.threads, False, target, self.slots,
                                           simt=self._simt(work, extents, m))
                       for m in MATMUL_MICROS}
            micro = min(MATMUL_MICROS, key=lambda m: (seconds[m], MATMUL_MICROS.index(m)))
            sch = self._apply(func, target, micro)
            if sch is not None and not isinstance(sch, list) and block_count(sch.mod["main"]) == counts[micro]:
                return sch
        best = None
        for micro in MATMUL_MICROS:
            sch = self._apply(func, target, micro)
            if sch is None or isinstance(sch, list):
                if best is None:
                    return sch
                break
            seconds = self.predicted_seconds(func, sch.mod["main"], target)
            if best is None or seconds < best[0]:
                best = (seconds, sch)
        return best[1]

    def predicted_seconds(self, func: tirx.PrimFunc, scheduled: tirx.PrimFunc, target: tvm.target.Target) -> float:
        """The latency model's time for the contraction of ``func`` in ``scheduled``'s tiles on
        the resident blocks of a stitched kernel (an estimate; grid-stride, so extra waves
        restart tiles)."""
        work = ContractionWork.of(func)
        extents = contraction_extents(func)
        return stitched_seconds(work, block_count(scheduled), self.threads, False, target, self.slots,
                                simt=self._simt(work, extents, self._micro) if extents else None)

    def _simt(self, work: ContractionWork, extents: tuple[int, ...], micro: int) -> SimtTile:
        """The tile's inner loop: K from the contraction's flops over its outputs."""
        k = max(work.flops // max(2 * math.prod(extents), 1), 1)
        return SimtTile(micro, self.k_tile, k)

    def _apply(self, func, target, micro: int):
        self._micro = micro
        sch = super().apply(func, target, False)
        if sch is None or isinstance(sch, list):
            return sch
        rows, cols = self.tile(micro)
        shared = [b for b in _blocks(sch) if any(str(w.source.ty.storage_scope) == "shared"
                                                 for w in sch.get(b).writes)]
        # Per K step each shared buffer holds a tile side x k_tile (the allocations still have
        # the full operand shape here; compaction comes later): counted at the longer side.
        total = sum(max(rows, cols) * self.k_tile * tir_stats.dtype_bytes(w.source.ty.dtype)
                    for b in shared for w in sch.get(b).writes)
        if total > STATIC_SHARED_LIMIT:
            for b in shared:
                sch.set_scope(b, 0, "shared.dyn")
        return s_tir.Schedule(sch.mod["main"].with_attr(GEMM_TILE_ATTR, [rows, cols]))


def _blocks(sch) -> list:
    """Every block under the root, depth-first."""
    out = []

    def visit(parent):
        for b in sch.get_child_blocks(parent):
            out.append(b)
            visit(b)
    visit(sch.get_sblock("root"))
    return out
