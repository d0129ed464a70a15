"""Matmul256: dlight's GEMM schedule at a stitched kernel's 256 threads (reported as "Matmul")."""

from __future__ import annotations

from tvm.s_tir import dlight as dl

from ...core import tir_stats
from ...core.geometry import MATMUL_K_TILE, MATMUL_MICRO, MATMUL_THREADS, MATMUL_TILE, STATIC_SHARED_LIMIT
from .base import CUDAScheduleRule


class Matmul256(CUDAScheduleRule, dl.gpu.Matmul):
    """dlight's GEMM schedule with a 16x16 thread block (dlight's own CUDA choice is 8x16)
    and a chosen K tile. Tiles past the 48 KB a kernel may declare statically go to
    dynamic shared memory (``shared.dyn``), which TVM's runtime opts in for at launch.

    (``import tvm`` already imports dlight, so subclassing it here costs no import time.)"""

    def __init__(self, k_tile: int = MATMUL_K_TILE):
        super().__init__()
        self.k_tile = k_tile

    @property
    def threads(self) -> int:
        return MATMUL_THREADS * MATMUL_THREADS

    @property
    def tile(self) -> tuple[int, int]:
        """The output tile one block writes (rows x columns): the one a two-phase partial shares."""
        return MATMUL_TILE, MATMUL_TILE

    def get_configs(self, target):
        config = super().get_configs(target)
        config.block_size_x = config.block_size_y = MATMUL_THREADS
        config.micro_size_x = config.micro_size_y = MATMUL_MICRO
        config.vthread_x = config.vthread_y = 1
        config.micro_size_k = self.k_tile
        return config

    def apply(self, func, target, tunable):
        sch = super().apply(func, target, tunable)
        if sch is None or isinstance(sch, list):
            return sch
        shared = [b for b in _blocks(sch) if any(str(w.source.ty.storage_scope) == "shared"
                                                 for w in sch.get(b).writes)]
        # Per K step each shared buffer holds a MATMUL_TILE x k_tile tile (the allocations
        # still have the full operand shape here; compaction comes later).
        total = sum(MATMUL_TILE * self.k_tile * tir_stats.dtype_bytes(w.source.ty.dtype)
                    for b in shared for w in sch.get(b).writes)
        if total > STATIC_SHARED_LIMIT:
            for b in shared:
                sch.set_scope(b, 0, "shared.dyn")
        return sch


def _blocks(sch) -> list:
    """Every block under the root, depth-first."""
    out = []

    def visit(parent):
        for b in sch.get_child_blocks(parent):
            out.append(b)
            visit(b)
    visit(sch.get_sblock("root"))
    return out
