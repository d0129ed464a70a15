"""StitchedMatmul: dlight's GEMM schedule at a stitched kernel's block size (reported as
"Matmul"), its tile sized to the kernel's grid."""

from __future__ import annotations

import math

import tvm
from tvm import s_tir, tirx
from tvm.s_tir import dlight as dl
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.s_tir.dlight.gpu.matmul import (auto_inline_consumer_chain, auto_inline_producers, check_sm_version,
                                         get_in_out_dtypes, get_index_map, get_reduction_blocks)

from ...cost import hardware, tir_stats
from ...core.geometry import (MATMUL_K_TILE, MATMUL_K_TILES, MATMUL_MICRO, MATMUL_MICROS, MATMUL_THREAD_GRIDS,
                              STATIC_SHARED_LIMIT, STITCH_BLOCK, STITCH_BLOCKS_PER_SM)
from ...core.ir_names import GEMM_K_TILE_ATTR, GEMM_TILE_ATTR
from . import coalesced_fetch
from .base import CUDAScheduleRule
from .gemm_tiles import (ContractionWork, SimtTile, block_count, contraction_extents, normalize, stitched_seconds,
                         tile_count)


class StitchedMatmul(CUDAScheduleRule, dl.gpu.Matmul):
    """dlight's GEMM schedule with the thread grid of a stitched kernel's block
    (``MATMUL_THREAD_GRIDS``: 16 x 16 at 256 threads; dlight's own CUDA choice is 8 x 16) and a
    chosen micro tile and K tile. Tiles past the 48 KB a kernel may declare statically go to
    dynamic shared memory (``shared.dyn``), which TVM's runtime opts in for at launch.

    The stage geometry: each thread computes ``micro x micro`` outputs, so at 256 threads a
    block's tile is 64, 32 or 16 wide. Unless ``micro`` is given, the rule prices each and
    keeps the one the latency model predicts fastest on ``slots`` resident blocks (default: a
    stitched kernel's, ``STITCH_BLOCKS_PER_SM`` per SM): a GEMM whose large tiles leave most of
    the grid idle takes smaller tiles that fill it, one whose tiles already fill whole waves
    keeps the operand reuse of the large tile. The choice reads only the GEMM's contraction
    (its heaviest block), so a GEMM gets the same tile with or without a fused epilogue, the
    tile a two-phase partial shares (``GEMM_TILE_ATTR`` on the schedule says which).

    The K loop is not pipelined: each K step loads both operands' slices into shared memory,
    waits for them at a barrier, then computes. Where a tile's K steps are its critical path
    (a GEMM of few tiles and a long K: EfficientNet's and ResNeXt's late 1x1 convolutions),
    fewer, longer steps wait fewer round trips for the same loads. Unless ``k_tile`` is given,
    the rule prices each K tile of ``MATMUL_K_TILES`` with the micro tiles and keeps the
    fastest; a longer one only where its shared memory still lets the blocks the tiles need
    share an SM (``_fits``), the shortest among equals (``GEMM_K_TILE_ATTR`` says which).

    (``import tvm`` already imports dlight, so subclassing it here costs no import time.)"""

    def __init__(self, k_tile: int | None = None, micro: int | None = None, slots: int | None = None,
                 threads: int = STITCH_BLOCK):
        super().__init__()
        if threads not in MATMUL_THREAD_GRIDS:
            raise ValueError(f"a stitched GEMM has {' or '.join(map(str, MATMUL_THREAD_GRIDS))} threads "
                             f"(asked: {threads})")
        self.k_tile, self.micro, self.slots = k_tile, micro, slots
        self.grid = MATMUL_THREAD_GRIDS[threads]
        self._micro = micro or MATMUL_MICRO     # what get_configs hands dlight
        self._k_tile = k_tile or MATMUL_K_TILE

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
        config.micro_size_k = self._k_tile
        return config

    def apply(self, func, target, tunable):
        if self.micro is not None and self.k_tile is not None:
            return self._apply(func, target, self.micro, self.k_tile)
        # (repeats are not scheduled again: planning.group_facts keeps the default rules' schedules
        # across compiles, and each GEMM's tile for the two-phase pass)
        extents = contraction_extents(func)
        if extents == ():
            return None       # dlight's GEMM rule finds no contraction here either
        micros = (self.micro,) if self.micro else MATMUL_MICROS
        if extents is not None:
            work = ContractionWork.of(func)
            k = _terms(work, extents)
            counts = {m: tile_count(extents, *self.tile(m)) for m in micros}
            # The tile count of each side is known before scheduling: schedule only the winner,
            # and search as below if its schedule has another count than predicted.
            seconds = {(m, kt): stitched_seconds(work, counts[m], self.threads, False, target, self.slots,
                                                 simt=SimtTile(m, kt, k))
                       for m in micros for kt in self._k_tiles(k) if self._fits(m, kt, counts[m], work, target)}
            # among equals the shortest step (least shared memory), then the micro tile's order
            micro, k_tile = min(seconds, key=lambda c: (seconds[c], c[1], MATMUL_MICROS.index(c[0])))
            sch = self._apply(func, target, micro, k_tile)
            if sch is not None and not isinstance(sch, list) and block_count(sch.mod["main"]) == counts[micro]:
                return sch
        best = None
        for micro in micros:
            sch = self._apply(func, target, micro, self.k_tile or MATMUL_K_TILE)
            if sch is None or isinstance(sch, list):
                if best is None:
                    return sch
                break
            seconds = self.predicted_seconds(func, sch.mod["main"], target)
            if best is None or seconds < best[0]:
                best = (seconds, sch)
        return best[1]

    def predicted_seconds(self, func: tirx.PrimFunc, scheduled: tirx.PrimFunc, target: tvm.target.Target) -> float:
        """The latency model's time for the contraction of ``func`` in ``scheduled``'s tiles (its
        ``GEMM_TILE_ATTR`` and ``GEMM_K_TILE_ATTR``) on the resident blocks of a stitched kernel
        (an estimate; grid-stride, so extra waves restart tiles)."""
        work = ContractionWork.of(func)
        extents = contraction_extents(func)
        attrs = scheduled.attrs if scheduled.attrs is not None else {}
        micro = int(attrs[GEMM_TILE_ATTR][0]) // self.grid[0] if GEMM_TILE_ATTR in attrs else self._micro
        k_tile = int(attrs[GEMM_K_TILE_ATTR]) if GEMM_K_TILE_ATTR in attrs else self._k_tile
        return stitched_seconds(work, block_count(scheduled), self.threads, False, target, self.slots,
                                simt=SimtTile(micro, k_tile, _terms(work, extents)) if extents else None)

    def _k_tiles(self, k: int) -> tuple[int, ...]:
        """The K tiles to price for a contraction of ``k`` terms: the one given, else the default
        and each longer one the contraction fills (a step past K would load padding)."""
        if self.k_tile is not None:
            return (self.k_tile,)
        return tuple(t for t in MATMUL_K_TILES if t == MATMUL_K_TILE or t <= k)

    def _fits(self, micro: int, k_tile: int, tiles: int, work: ContractionWork, target) -> bool:
        """Whether a K tile longer than the default keeps the blocks the GEMM's ``tiles`` need
        per SM resident (at most the ``slots`` the model prices them on: by default a stitched
        kernel's ``STITCH_BLOCKS_PER_SM`` of 256 threads), its operand slices within the static
        shared-memory limit: the model does not price the occupancy a longer step's shared
        memory costs, so a choice must not lose any."""
        if self.k_tile is not None or k_tile == MATMUL_K_TILE:
            return True
        gpu = hardware.for_arch(str(target.attrs.get("arch", "sm_90")))
        shared = 2 * _slice_bytes(self.tile(micro), k_tile, work.elem_bytes)
        slots = self.slots or gpu.sms * max(1, STITCH_BLOCKS_PER_SM * STITCH_BLOCK // self.threads)
        per_sm = math.ceil(min(tiles, slots) / gpu.sms)
        return shared <= STATIC_SHARED_LIMIT and hardware.occupancy(gpu, self.threads, 0, shared).blocks_per_sm >= per_sm

    def _apply(self, func, target, micro: int, k_tile: int):
        self._micro, self._k_tile = micro, k_tile
        sch = self._schedule(func, target)
        if sch is None or isinstance(sch, list):
            return sch
        rows, cols = self.tile(micro)
        shared = [b for b in _blocks(sch) if any(str(w.source.ty.storage_scope) == "shared"
                                                 for w in sch.get(b).writes)]
        total = sum(_slice_bytes((rows, cols), k_tile, tir_stats.dtype_bytes(w.source.ty.dtype))
                    for b in shared for w in sch.get(b).writes)
        if total > STATIC_SHARED_LIMIT:
            for b in shared:
                sch.set_scope(b, 0, "shared.dyn")
        return s_tir.Schedule(sch.mod["main"].with_attr(GEMM_TILE_ATTR, [rows, cols])
                              .with_attr(GEMM_K_TILE_ATTR, k_tile))


    def _schedule(self, func: tirx.PrimFunc, target: tvm.target.Target) -> s_tir.Schedule | None:  # noqa: C901
        """dlight's ``Matmul.apply`` on CUDA (tvm/s_tir/dlight/gpu/matmul.py, steps 0 and 2),
        unchanged but for the operand copies (``coalesced_fetch``); a GEMM dlight hands to its
        tensor-core rule (step 1) goes there."""
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        config = self.get_configs(target)
        sch = s_tir.Schedule(func)
        reduction_blocks = get_reduction_blocks(sch, sch.get_child_blocks(get_root_block(sch)))
        if reduction_blocks is None or not get_index_map(sch.get(reduction_blocks[0])):
            return None
        main_block = reduction_blocks[0]
        normalize(sch, main_block)      # C[S, I, J] += A[S, I, K] * B[S, J, K]
        if _tensorizes(sch.get(main_block), target):
            return super().apply(func, target, False)

        rows, cols = config.block_size_x * config.micro_size_x, config.block_size_y * config.micro_size_y
        sch.pad_einsum(main_block, [1, rows, cols, config.micro_size_k])
        batch, x, y, k = sch.get_loops(main_block)
        by, vy, ty, yi = sch.split(y, [None, 1, config.block_size_y, config.micro_size_y])
        bx, vx, tx, xi = sch.split(x, [None, 1, config.block_size_x, config.micro_size_x])
        ko, ki = sch.split(k, factors=[None, config.micro_size_k])
        sch.reorder(by, bx, vy, vx, ty, tx, ko, ki, xi, yi)
        by = sch.fuse(batch, by)
        sch.bind(bx, "blockIdx.x")
        sch.bind(by, "blockIdx.y")
        sch.bind(vy, "vthread.y")
        sch.bind(vx, "vthread.x")
        sch.bind(ty, "threadIdx.y")
        sch.bind(tx, "threadIdx.x")
        if config.micro_size_y % config.vector_size == 0:
            _, v = sch.split(yi, [None, config.vector_size])
            sch.vectorize(v)
        sch.annotate(tx, ann_key="pragma_auto_unroll_max_step", ann_val=config.unroll)
        sch.annotate(tx, ann_key="pragma_unroll_explicit", ann_val=1)
        l2g = sch.cache_write(main_block, 0, "local")
        sch.reverse_compute_at(l2g, tx, preserve_unit_loops=True)
        if config.micro_size_x % config.vector_size == 0:
            _, v = sch.split(sch.get_loops(l2g)[-1], [None, config.vector_size])
            sch.vectorize(v)
        copies = []
        for operand in (0, 1):
            copy = sch.cache_read(main_block, operand, "shared")
            sch.compute_at(copy, ko, preserve_unit_loops=True)
            copies.append(copy)
        for copy in copies:
            auto_inline_producers(sch, copy)      # before the layout: the copy reads the source itself
            coalesced_fetch.fetch(sch, copy, (config.block_size_y, config.block_size_x), config.vector_size,
                                  config.storage_align)
        auto_inline_consumer_chain(sch, l2g)
        sch.decompose_reduction(main_block, ko)
        return sch


def _tensorizes(block: tirx.SBlock, target: tvm.target.Target) -> bool:
    """dlight's step 1: whether its ``Matmul`` hands this normalised GEMM to a tensor-core rule."""
    if check_sm_version(str(target.attrs.get("arch", ""))) < 70:
        return False
    if any(isinstance(iv.dom.extent, tirx.IntImm) and iv.dom.extent.value <= 64 for iv in block.iter_vars[1:]):
        return False
    return get_in_out_dtypes(block) in (("int8", "int32"), ("float16", "float16"), ("float16", "float32"))


def _terms(work: ContractionWork, extents: tuple[int, ...]) -> int:
    """The contraction's K: its flops over its outputs."""
    return max(work.flops // max(2 * math.prod(extents), 1), 1)


def _slice_bytes(tile: tuple[int, int], k_tile: int, elem_bytes: int) -> int:
    """One operand's slice of a K step in shared memory, counted at the tile's longer side (the
    allocations still have the full operand shape when the schedule is made; compaction comes
    later)."""
    return max(tile) * k_tile * elem_bytes


def _blocks(sch) -> list:
    """Every block under the root, depth-first."""
    out = []

    def visit(parent):
        for b in sch.get_child_blocks(parent):
            out.append(b)
            visit(b)
    visit(sch.get_sblock("root"))
    return out
