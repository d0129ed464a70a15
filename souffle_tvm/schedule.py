"""Per-group schedules: TVM's dlight rules on CUDA; the plain loop nest on llvm (the CPU twin).

Rules are tried in dlight's order (Matmul, GEMV, Reduction, GeneralReduction, Fallback); a
rule that raises on a fused group is skipped like one that does not match, so the result
says *which* rule scheduled the group. The partitioner compares that with the rule its anchor
gets alone: fusing must not degrade a tiled GEMM to the fallback schedule.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import tvm
from tvm import tirx

from . import tir_stats
from .errors import SouffleError
from .targets import is_cuda


class ScheduleError(SouffleError):
    """A group's PrimFunc could not be scheduled as one kernel."""


@dataclass
class Scheduled:
    func: tirx.PrimFunc
    rule: str          # the dlight rule that applied ("none" on llvm)
    notes: str = ""    # rules that raised before one applied


# How much of the hardware a rule's schedule uses; fusing must not lower it.
RANK = {"Matmul": 3, "PartialRows": 2, "GEMV": 2, "Reduction": 2, "GeneralReduction": 2, "Fallback": 0, "none": 0}


def _rules(block_size: int | None, gemm_k_tile: int | None = None):
    from tvm.s_tir import dlight as dl

    if block_size is None:
        return [dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(), dl.gpu.Fallback()]
    # One block size for every stage of a stitched kernel: rules whose thread count is fixed
    # by the rule itself (GEMV, Reduction) are left out.
    if block_size != 256:
        raise ScheduleError(f"stitched stages are scheduled with 256 threads (asked: {block_size})")
    return [PartialRows(), _Matmul256(gemm_k_tile or MATMUL_K_TILE), dl.gpu.GeneralReduction(), dl.gpu.Fallback()]


# The stitched GEMM schedule's block tile (rows x columns): 16x16 threads, 4x4 outputs each.
MATMUL_THREADS, MATMUL_MICRO = 16, 4
MATMUL_TILE = MATMUL_THREADS * MATMUL_MICRO
MATMUL_K_TILE = 16            # dlight's CUDA default; larger K tiles need more shared memory
STATIC_SHARED_LIMIT = 48 * 1024


class PartialRows:
    """The first phase of a two-phase reduction (``transforms.two_phase``), laid out like the
    GEMM that feeds it: block (x = row tile, y = the leading axes fused with the column tile),
    one thread per row of the tile, the tile's columns reduced serially. Each block then reads
    exactly the tile the same-numbered GEMM block wrote, which the stitcher can prove."""

    def apply(self, func, target, _tune):
        from tvm import s_tir

        sch = s_tir.Schedule(func)
        blocks = sch.get_child_blocks(sch.get_sblock("root"))
        tiles = {int(sch.get(b).annotations.get("souffle_partial_tile", 0)) for b in blocks}
        if len(tiles) != 1 or 0 in tiles:
            return None
        (tile,) = tiles
        *lead, rows, col, red = sch.get_loops(blocks[0])
        ro, ri = sch.split(rows, [None, tile])
        sch.reorder(ro, *lead, col, ri, red)
        by = sch.fuse(*lead, col) if lead else col
        sch.bind(ro, "blockIdx.x")
        sch.bind(by, "blockIdx.y")
        sch.bind(ri, "threadIdx.x")
        for b in blocks[1:]:     # later partials of the same rows: same threads, same loop
            sch.reverse_compute_at(b, ri)
        return sch


@functools.cache
def _matmul256_class():
    from tvm.s_tir import dlight as dl

    class Matmul256(dl.gpu.Matmul):
        """dlight's GEMM schedule with a 16x16 thread block (dlight's own CUDA choice is 8x16)
        and a chosen K tile. Tiles past the 48 KB a kernel may declare statically go to
        dynamic shared memory (``shared.dyn``), which TVM's runtime opts in for at launch."""

        def __init__(self, k_tile: int = MATMUL_K_TILE):
            super().__init__()
            self.k_tile = k_tile

        def get_configs(self, target):
            config = super().get_configs(target)
            config.block_size_x = config.block_size_y = MATMUL_THREADS
            config.micro_size_x = config.micro_size_y = MATMUL_MICRO
            config.vthread_x = config.vthread_y = 1
            config.micro_size_k = self.k_tile
            return config

        def apply(self, func, target, tune):
            sch = super().apply(func, target, tune)
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

    return Matmul256


def _blocks(sch) -> list:
    out = []

    def visit(parent):
        for b in sch.get_child_blocks(parent):
            out.append(b)
            visit(b)
    visit(sch.get_sblock("root"))
    return out


def _Matmul256(k_tile: int = MATMUL_K_TILE):  # noqa: N802
    return _matmul256_class()(k_tile)


def schedule_group(func: tirx.PrimFunc, target: tvm.target.Target, block_size: int | None = None,
                   gemm_k_tile: int | None = None) -> Scheduled:
    """Schedule ``func`` for ``target`` with the first dlight rule that applies.

    ``block_size`` forces every rule to use that many threads per block (stitched kernels);
    ``gemm_k_tile`` sets the stitched GEMMs' K tile (shared tiles over 48 KB become dynamic).
    """
    if not is_cuda(target):
        return Scheduled(func, "none")
    if block_size is not None:
        attrs = dict(target.attrs)
        attrs.update({"kind": "cuda", "max_num_threads": block_size, "max_threads_per_block": block_size})
        attrs.pop("keys", None)
        target = tvm.target.Target(attrs)
    failures = []
    with target:
        for rule in _rules(block_size, gemm_k_tile):
            try:
                sch = rule.apply(func, target, False)
            except Exception as err:  # noqa: BLE001 - a rule's assertion means "does not apply here"
                lines = str(err).strip().splitlines()
                failures.append(f"{type(rule).__name__}: {type(err).__name__} {(lines[-1] if lines else '')[:120]}")
                continue
            if sch is None:
                continue
            if isinstance(sch, list):
                sch = sch[0]
            out = sch.mod["main"].with_attr("tirx.is_scheduled", True)
            name = type(rule).__name__.replace("Matmul256", "Matmul")
            return Scheduled(out, name, "; ".join(failures))
    raise ScheduleError("no dlight rule schedules it: " + "; ".join(failures))
