"""What the stitched GEMM rules read of a contraction before scheduling it: its extents as
dlight normalises them, the tile count of a tile shape, and the latency model's time for those
tiles on a stitched kernel's resident blocks (``StitchedMatmul`` and ``TensorCoreMatmul`` choose
their tile with it, ``SerialReduction`` its form)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.s_tir.dlight.gpu.matmul import get_index_map, get_reduction_blocks

from ...cost import hardware, latency, tir_stats
from ...core.geometry import STITCH_BLOCK, STITCH_BLOCKS_PER_SM
from ...cost.work import Stage, WIDEST_LANE_ACCESS


def contraction_extents(func: tirx.PrimFunc) -> tuple[int, ...] | None:
    """(batch, rows, columns) of ``func``'s contraction normalised as dlight's GEMM rule does it
    (``C[S, I, J] += A[S, I, K] * B[S, J, K]``); () where that rule finds no contraction; None
    where the extents are not constants."""
    sch = s_tir.Schedule(func)
    reductions = get_reduction_blocks(sch, sch.get_child_blocks(get_root_block(sch)))
    block = sch.get(reductions[0]) if reductions else None
    maps = get_index_map(block) if block is not None else None
    if maps is None:
        return ()
    shape = maps[0].map_shape([iv.dom.extent for iv in block.iter_vars])
    if len(shape) != 4 or not all(isinstance(e, tirx.IntImm) for e in shape):
        return None
    return tuple(int(e) for e in shape[:3])


def normalize(sch: s_tir.Schedule, block) -> None:
    """dlight's step 0 (tvm/s_tir/dlight/gpu/matmul.py): the GEMM ``block`` rewritten to
    ``C[S, I, J] += A[S, I, K] * B[S, J, K]`` through reindexed operands and output."""
    reindex_a = sch.reindex(block, ("read", 0))
    reindex_b = sch.reindex(block, ("read", 1))
    reindex_c = sch.reindex(block, ("write", 0))
    matmul_index_map, a_index_map, b_index_map, c_index_map = get_index_map(sch.get(block))
    sch.transform_layout(reindex_a, ("write", 0), a_index_map)
    sch.transform_layout(reindex_b, ("write", 0), b_index_map)
    sch.transform_layout(reindex_c, ("read", 0), c_index_map)
    sch.transform_block_layout(block, matmul_index_map)


def tile_count(extents: tuple[int, ...], rows: int, cols: int) -> int:
    """Blocks of ``rows x cols`` output tiles over a contraction of ``extents``."""
    batch, m, n = extents
    return batch * -(-m // rows) * -(-n // cols)


def predicted_blocks(func: tirx.PrimFunc, side: int) -> int | None:
    """Blocks dlight's GEMM schedule of ``func`` launches with a ``side`` x ``side`` output
    tile, read before scheduling; None where that is not known."""
    extents = contraction_extents(func)
    return tile_count(extents, side, side) if extents else None


def block_count(func: tirx.PrimFunc) -> int:
    """Blocks a scheduled PrimFunc launches: the product of its ``blockIdx`` loop extents."""
    count = [1]

    def loop(node):
        if node.thread_binding is not None and str(node.thread_binding.thread_tag).startswith("blockIdx"):
            count[0] *= int(node.extent.value) if hasattr(node.extent, "value") else 1

    tvm_ffi.structural_walk(func.body, (tirx.For, loop))
    return count[0]


@dataclass(frozen=True)
class ContractionWork:
    """The latency model's view of a GEMM group's contraction (its heaviest block): flops,
    footprint, the bytes it writes to parameters, and the group's stored element size.

    ``written`` is 0 where an epilogue follows the contraction in the group (its accumulator is
    not a parameter): the model then prices no operand re-reads, only each tile's share of the
    footprint. Pricing the re-reads there instead (the group's output bytes, as the partitioner
    does) chose larger tiles for the stitched grid's 3 blocks per SM that the partitioner then
    priced up to 2x slower as kernels of their own, which have more resident blocks (ResNeXt
    full: 4.51 -> 5.50 ms predicted); fp16 models gained nothing from it (BERT equal, Swin
    2.92 -> 3.00 ms)."""
    flops: int
    bytes: int
    written: int
    elem_bytes: int

    @classmethod
    def of(cls, func: tirx.PrimFunc) -> "ContractionWork":
        _, flops, nbytes, written = tir_stats.heaviest_block(func)
        return cls(flops, nbytes, written, tir_stats.stored_element_bytes(func))


@dataclass(frozen=True)
class SimtTile:
    """A SIMT GEMM tile's inner loop, for the static floors: each thread computes ``micro x
    micro`` outputs over ``k`` terms in K steps of ``k_tile``, reading ``micro`` elements of each
    operand from shared memory per term."""
    micro: int
    k_tile: int
    k: int

    def shared_wavefronts(self, threads: int, elem_bytes: int) -> float:
        """Per tile, at least (``cost.floors``: 16 bytes a lane per wavefront)."""
        return math.ceil(threads / 32) * self.k * 2 * self.micro * elem_bytes / WIDEST_LANE_ACCESS

    def k_steps(self) -> int:
        return math.ceil(self.k / self.k_tile)


def stitched_seconds(work: ContractionWork, tiles: int, threads: int, tensor_core: bool,
                     target: tvm.target.Target, slots: int | None = None, padding: float = 1.0,
                     simt: SimtTile | None = None) -> float:
    """The latency model's time for ``work`` in ``tiles`` blocks of ``threads`` on ``slots``
    resident blocks (default: a stitched kernel's, ``STITCH_BLOCKS_PER_SM`` blocks of
    ``STITCH_BLOCK`` threads per SM, as many threads in blocks of ``threads``; grid-stride, so
    extra waves restart tiles). ``padding``: the computed over the true output area, where
    tiles past the GEMM's edge compute padding (an estimate). ``simt``: the SIMT tile's inner
    loop, whose shared-memory and K-step floors the time is then never below."""
    gpu = hardware.for_arch(str(target.attrs.get("arch", "sm_90")))
    extra = {"shared_wavefronts": simt.shared_wavefronts(threads, work.elem_bytes), "k_steps": simt.k_steps()} \
        if simt else {}
    stage = Stage(tiles, threads, work.bytes, math.ceil(work.flops * padding), tensor_core, work.written,
                          work.elem_bytes, **extra)
    per_sm = max(1, STITCH_BLOCKS_PER_SM * STITCH_BLOCK // threads)
    return latency.stage_time(gpu, latency.FITTED, stage, slots or gpu.sms * per_sm, persistent=True).seconds


def tensor_core_dtypes(arch: str) -> tuple[tuple[str, str], ...]:
    """The (input, accumulator) types ``TensorCoreMatmul`` tensorizes on ``arch`` ("sm_90"): fp16 with fp16
    or fp32 accumulation from sm_70, bf16 with fp32 accumulation from sm_80 (wmma has no bf16
    before Ampere, and no bf16 accumulator at all)."""
    sm = int(arch[3:]) if arch.startswith("sm_") and arch[3:].isdigit() else 0
    fp16 = (("float16", "float16"), ("float16", "float32"))
    return () if sm < 70 else fp16 if sm < 80 else fp16 + (("bfloat16", "float32"),)
