"""TensorCoreMatmul: tensor-core GEMM stages that fit a stitched kernel's block (256 threads, or
128 or 512 where a subprogram takes that size), their tile sized to the kernel's grid.

dlight's ``MatmulTensorization`` (the rule its ``Matmul`` hands fp16 GEMMs to on sm_70+) fixes
its warp grid at 4 x 4 = 16 warps, 512 threads, inside one long ``apply``: an fp16 model's
GEMMs then cannot join a 256-thread stitched kernel, and every one of them ends a subprogram
(BERT-base fp16: 84 kernels instead of fp32's 12). This is that rule with the warp grid as
parameter: at 256 threads 8 warps (2 x 4 or 4 x 2), each 1 x 1 to 2 x 2 wmma 16x16x16 fragments,
so a block computes a tile from 32 x 64 to 64 x 128 (dlight's: 128 x 128, 4 x 4 warps of 2 x 2;
``TILES_BY_WARPS`` has those of 4 and 16 warps too), with the
same K tile of 64 and the same two-stage software pipeline through dynamic shared memory.
The schedule steps are dlight's (tvm/s_tir/dlight/gpu/matmul.py, MatmulTensorization.apply),
unchanged but for the factors and a guard against GEMMs too small for tensor cores (the test
dlight's ``Matmul`` applies before handing over).

Why the tile is chosen: dlight's fixed 128 x 128 tile gives BERT-base's 384 x 768 GEMMs 18
blocks on an H200's 132 SMs. The rule reads the contraction's extents before scheduling and
keeps the tile the latency model predicts fastest on the kernel's resident blocks (as
``StitchedMatmul`` does for the SIMT tile); a GEMM whose large tiles already fill the grid keeps
their operand reuse.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import s_tir, tirx

from ...core.ir_names import GEMM_TILE_ATTR
from .base import CUDAScheduleRule
from .gemm_tiles import ContractionWork, normalize, stitched_seconds, tensor_core_dtypes, tile_count

# wmma fragment, and the smallest GEMM dimension dlight's Matmul still tensorizes
MICRO = 16
MIN_EXTENT = 64
WARPS = 8       # 256 threads, a stitched kernel's block


@dataclass(frozen=True)
class WarpTile:
    """A block's output tile: ``warps_m x warps_n`` warps, each ``frags_m x frags_n`` wmma fragments."""
    warps_m: int
    warps_n: int
    frags_m: int
    frags_n: int

    @property
    def rows(self) -> int:
        return MICRO * self.warps_m * self.frags_m

    @property
    def cols(self) -> int:
        return MICRO * self.warps_n * self.frags_n


# The tiles the rule chooses from, largest first and, at one size, squarest first: the model
# prices a tile's operand loads as a square's, so a tie keeps the tile that re-reads least.
TILES = (WarpTile(2, 4, 2, 2), WarpTile(4, 2, 2, 2), WarpTile(2, 4, 2, 1), WarpTile(2, 4, 1, 2),
         WarpTile(4, 2, 2, 1), WarpTile(2, 4, 1, 1), WarpTile(4, 2, 1, 1))
DEFAULT_TILE = TILES[0]     # 64 x 128
# per warp count (a block of 128, 256 or 512 threads): the tiles, in the same order of preference
TILES_BY_WARPS = {
    4: (WarpTile(2, 2, 2, 2), WarpTile(2, 2, 2, 1), WarpTile(2, 2, 1, 2), WarpTile(2, 2, 1, 1)),
    WARPS: TILES,
    16: (WarpTile(4, 4, 2, 2), WarpTile(4, 4, 2, 1), WarpTile(4, 4, 1, 2), WarpTile(4, 4, 1, 1)),
}


# TVM 0.27 registers wmma intrinsics for fp16, int8 and int4 only; its generators take bf16 as they
# are (nvcuda::wmma has bf16 fragments from sm_80), under the names ``get_wmma_intrin_group`` would give
_BF16 = {"load_a": "wmma_load_16x16x16_bf16_a_shared_dyn", "load_b": "wmma_load_16x16x16_bf16_b_trans_shared_dyn",
         "compute": "wmma_sync_16x16x16_bf16bf16f32_trans", "init": "wmma_fill_16x16x16_f32",
         "store": "wmma_store_16x16x16_f32_shared_dyn"}


def _wmma_group(in_dtype: str, out_dtype: str) -> dict[str, str]:
    """The wmma intrinsics for ``in_dtype`` operands accumulated in ``out_dtype`` (shared.dyn
    operands, B transposed), bf16's registered on first use."""
    from tvm.s_tir import TensorIntrin
    from tvm.s_tir.tensor_intrin.cuda import get_wmma_intrin_group, get_wmma_load_intrin, get_wmma_sync_intrin

    if in_dtype != "bfloat16":
        return get_wmma_intrin_group(load_scope="shared.dyn", store_scope="shared.dyn", in_dtype=in_dtype,
                                     out_dtype=out_dtype, trans_b=True)
    made = {"load_a": lambda: get_wmma_load_intrin(MICRO, MICRO, MICRO, in_dtype, "shared.dyn", False, False),
            "load_b": lambda: get_wmma_load_intrin(MICRO, MICRO, MICRO, in_dtype, "shared.dyn", True, True),
            "compute": lambda: get_wmma_sync_intrin(MICRO, MICRO, MICRO, in_dtype, "float32", True)}
    for role, make in made.items():
        if TensorIntrin.get(_BF16[role], allow_missing=True) is None:
            TensorIntrin.register(_BF16[role], *make())
    return dict(_BF16)


class TensorCoreMatmul(CUDAScheduleRule):
    """fp16 GEMM (fp16 or fp32 accumulate) or bf16 GEMM (fp32 accumulate) on tensor cores with 8
    warps. Applies on sm_70+ (bf16: sm_80+) to a GEMM whose every fixed dimension is > 64,
    unless the function has the ``dlight.do_not_tensorize`` attribute.

    ``dtypes``: the (input, accumulator) types it takes, of those the arch allows (default: all).
    ``tile``: the block's output tile (one of ``TILES``); None: per GEMM, the one the latency
    model predicts fastest on ``slots`` resident blocks (default: a stitched kernel's,
    ``STITCH_BLOCKS_PER_SM`` per SM). The schedule carries the tile as ``GEMM_TILE_ATTR``
    (rows, columns): the tile a two-phase partial shares."""

    def __init__(self, tile: WarpTile | None = None, k_frags: int = 4, slots: int | None = None,
                 warps: int = WARPS, dtypes: tuple[tuple[str, str], ...] | None = None):
        if warps not in TILES_BY_WARPS:
            raise ValueError(f"a tensor-core block has {' or '.join(map(str, TILES_BY_WARPS))} warps (asked: {warps})")
        if tile is not None and tile.warps_m * tile.warps_n != warps:
            raise ValueError(f"a tensor-core tile has {warps} warps (asked: {tile})")
        self.tile, self.k_frags, self.slots, self.warps = tile, k_frags, slots, warps
        self.dtypes = dtypes

    @property
    def threads(self) -> int:
        return self.warps * 32

    def predicted_seconds(self, func: tirx.PrimFunc, extents: tuple[int, int, int], tile: WarpTile,
                          target: tvm.target.Target) -> float:
        """The latency model's time for ``func``'s contraction of ``extents`` (batch, rows,
        columns, as dlight normalises it) in ``tile``s on the resident blocks of a stitched
        kernel (an estimate). A tile past the GEMM's edge computes its padding too."""
        return self._seconds(ContractionWork.of(func), extents, tile, target)

    def _seconds(self, work: ContractionWork, extents: tuple[int, int, int], tile: WarpTile,
                 target: tvm.target.Target) -> float:
        _, rows, cols = extents
        tiles = tile_count(extents, tile.rows, tile.cols)
        padding = -(-rows // tile.rows) * tile.rows * -(-cols // tile.cols) * tile.cols / (rows * cols)
        return stitched_seconds(work, tiles, self.threads, True, target, self.slots, padding)

    def apply(self, func: tirx.PrimFunc, target: tvm.target.Target,  # noqa: C901 - dlight's steps
              tunable: bool) -> s_tir.Schedule | None:
        from tvm.s_tir.dlight.analysis import get_root_block
        from tvm.s_tir.dlight.gpu.matmul import (auto_inline_consumer_chain, auto_inline_producers,
                                                 get_in_out_dtypes, get_index_map, get_reduction_blocks)

        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        arch = str(target.attrs.get("arch", ""))
        if not arch.startswith("sm_") or int(arch[3:]) < 70 or "dlight.do_not_tensorize" in func.attrs.keys():
            return None
        sch = s_tir.Schedule(func)
        reduction_blocks = get_reduction_blocks(sch, sch.get_child_blocks(get_root_block(sch)))
        if reduction_blocks is None or get_index_map(sch.get(reduction_blocks[0])) is None:
            return None
        in_out = get_in_out_dtypes(sch.get(reduction_blocks[0]))
        if in_out not in tensor_core_dtypes(arch) or (self.dtypes is not None and in_out not in self.dtypes):
            return None

        main_block = reduction_blocks[0]
        normalize(sch, main_block)      # C[S, I, J] += A[S, I, K] * B[S, J, K]
        extents = [iv.dom.extent for iv in sch.get(main_block).iter_vars]
        if any(isinstance(e, tirx.IntImm) and e.value <= MIN_EXTENT for e in extents[1:]):
            return None      # too small for tensor cores: the SIMT rule takes it
        tile = self.tile
        if tile is None:
            if all(isinstance(e, tirx.IntImm) for e in extents[:3]):
                fixed, work = tuple(int(e) for e in extents[:3]), ContractionWork.of(func)
                tiles = TILES_BY_WARPS[self.warps]
                seconds = {t: self._seconds(work, fixed, t, target) for t in tiles}
                tile = min(tiles, key=lambda t: (seconds[t], tiles.index(t)))
            else:
                tile = TILES_BY_WARPS[self.warps][0]
        warp_size, vector_size = 32, 4
        i_factors = [None, 1, tile.warps_m, tile.frags_m]
        j_factors = [1, None, tile.warps_n, tile.frags_n]
        k_factors = [None, self.k_frags]
        num_ty = self.warps

        # Only now (a GEMM that tensorizes): importing the intrinsics costs ~10 s per process,
        # the whole tensor_intrin package (every target's) three times that.
        from ..database import register_tensor_intrinsics

        register_tensor_intrinsics(target)

        sch.pad_einsum(main_block, [1, tile.rows, tile.cols, MICRO * self.k_frags])
        block = main_block
        batch, i, j, k = sch.get_loops(block)
        i, i_inner = sch.split(i, factors=[None, MICRO])
        j, j_inner = sch.split(j, factors=[None, MICRO])
        k, k_inner = sch.split(k, factors=[None, MICRO])
        sch.reorder(i, j, k, i_inner, j_inner, k_inner)
        block_inner = block
        block_outer = sch.blockize(i_inner)
        i0, i1, i2, i3 = sch.split(i, factors=i_factors)
        j0, j1, j2, j3 = sch.split(j, factors=j_factors)
        k0, k1 = sch.split(k, k_factors)
        sch.annotate(k0, "software_pipeline_order", [0, 3, 1, 4, 5, 2, 6])
        sch.annotate(k0, "software_pipeline_stage", [0, 0, 0, 0, 0, 1, 1])
        sch.annotate(k1, "software_pipeline_order", [0, 1, 2])
        sch.annotate(k1, "software_pipeline_stage", [0, 0, 1])
        sch.reorder(i0, j0, i1, j1, j2, i2, k0, k1, i3, j3)
        block_idx = sch.fuse(i0, j0)
        block_idy = sch.fuse(i1, j1)
        thread_idy = sch.fuse(j2, i2)
        sch.bind(batch, "blockIdx.z")
        sch.bind(block_idx, "blockIdx.x")
        sch.bind(block_idy, "blockIdx.y")
        sch.bind(thread_idy, "threadIdx.y")

        def fetch_to_shared(blk, idx, ndim):
            block_read = sch.cache_read(blk, idx, "shared.dyn")
            sch.compute_at(block_read, k0)
            fused = sch.fuse(*sch.get_loops(block_read)[-ndim:])
            _, f_1, f_2, f_3 = sch.split(fused, factors=[None, num_ty, warp_size, vector_size])
            sch.bind(f_2, "threadIdx.x")
            sch.bind(f_1, "threadIdx.y")
            sch.vectorize(f_3)
            sch.storage_align(block_read, 0, axis=-2, factor=16, offset=8)
            sch.annotate(block_read, "tirx.manifest_shared_memory_local_stage", 1)
            sch.annotate(block_read, "double_buffer_scope", 0)
            return block_read

        a_g2s = fetch_to_shared(block_outer, 0, 2)
        b_g2s = fetch_to_shared(block_outer, 1, 2)
        auto_inline_producers(sch, a_g2s)
        auto_inline_producers(sch, b_g2s)

        a_mat = sch.cache_read(block_outer, 0, "wmma.matrix_a")
        b_mat = sch.cache_read(block_outer, 1, "wmma.matrix_b")
        sch.compute_at(a_mat, k1)
        sch.compute_at(b_mat, k1)
        acc_shared = sch.cache_write(block_outer, 0, "shared.dyn")
        sch.storage_align(acc_shared, 0, -2, 16, 4)
        store = sch.cache_write(block_outer, 0, "wmma.accumulator")
        sch.reverse_compute_at(store, thread_idy)
        sch.reverse_compute_at(acc_shared, thread_idy)
        si, sj = sch.get_loops(store)[-2:]
        si0, si1 = sch.split(si, factors=[None, MICRO])
        sj0, sj1 = sch.split(sj, factors=[None, MICRO])
        sch.reorder(si0, sj0, si1, sj1)
        block_init_c = sch.decompose_reduction(block_outer, k0)
        block_init_c_inner = sch.get_child_blocks(block_init_c)[0]

        intrin = _wmma_group(in_out[0], "float32")
        for mat, name in ((a_mat, "load_a"), (b_mat, "load_b")):
            mi, mj = sch.get_loops(mat)[-2:]
            mi0, mi1 = sch.split(mi, factors=[None, MICRO])
            mj0, mj1 = sch.split(mj, factors=[None, MICRO])
            sch.reorder(mi0, mj0, mi1, mj1)
            sch.unroll(mi0)
            sch.unroll(mj0)
            sch.tensorize(mi1, intrin[name])

        def tensorize_init_store_compute(group):
            sch.tensorize(sch.get_loops(block_init_c_inner)[-2], group["init"])
            sch.tensorize(sch.get_loops(store)[-2], group["store"])
            sch.tensorize(sch.get_loops(block_inner)[-3], group["compute"])

        try:
            tensorize_init_store_compute(intrin)
        except Exception:  # noqa: BLE001 - the fp32 pattern does not match an fp16 accumulator (dlight's retry)
            tensorize_init_store_compute(_wmma_group(in_out[0], "float16"))
        auto_inline_consumer_chain(sch, acc_shared)
        fused = sch.fuse(*sch.get_loops(acc_shared)[-2:])
        _, f1, f2 = sch.split(fused, factors=[None, warp_size, vector_size])
        sch.bind(f1, "threadIdx.x")
        sch.vectorize(f2)
        return s_tir.Schedule(sch.mod["main"].with_attr(GEMM_TILE_ATTR, [tile.rows, tile.cols]))
