"""The questions the two-phase transform asks (``transforms.two_phase`` takes the answers as
predicates): which output tile of a GEMM's stitched schedule a partial can share
(``gemm_tile``), whether the latency model predicts a split faster (``split_pays``), and which
row reductions a row chain holds whole on chip instead (``held_whole``)."""

from __future__ import annotations

import math

import tvm_ffi
from tvm import te, tirx

from ..codegen import emit
from ..codegen.rules import StitchedMatmul, TensorCoreMatmul
from ..core.geometry import STITCH_BLOCK
from ..core.ir_names import GEMM_TILE_ATTR
from ..core.targets import make_target
from ..cost import hardware, latency
from ..cost.work import Stage
from ..errors import ScheduleError, StitchError
from ..partition.groups import Group, readers_of
from ..stitch import lower
from ..te import chains
from ..transforms.two_phase import Candidate
from .schedules import default_schedule


def held_whole(prog) -> dict:
    """op -> why its rows stay whole: the row reductions of the program's row chains
    (``te.chains``), which the chain's kernel reduces on chip instead of in two phases."""
    return {m.op: f"its rows are held whole on chip ({chain.describe()})"
            for chain in chains.row_chains(prog.stages(), readers_of(prog))
            for m in chain.stages[1:-1] if m.op.reduce_axis}


_TILES: dict = {}    # memo across compiles: structural hash of a GEMM's group PrimFunc -> answer


def gemm_tile(gemm: te.Tensor, side: int | None = None) -> tuple[int, int] | None:
    """The output tile (rows, columns) one block of ``gemm``'s stitched schedule writes, or
    None when it has no such tile a two-phase partial could share: each stitched GEMM rule sizes
    it to the stitched grid (``Matmul``: a square 64, 32 or 16 wide, 16x16 threads;
    ``TensorCoreMatmul``, fp16: 32 x 64 to 64 x 128) and says which on the schedule
    (``GEMM_TILE_ATTR``). Decided for CUDA, whatever the target, so the CPU twin runs the same
    program. ``side``: the SIMT tile side the options fix (``Options.gemm_tile``).
    The stitcher still proves each partial block-local (else it
    keeps a grid sync): this answer only says where a proof can succeed."""
    func, _ = emit.group_primfunc(Group([gemm]), [gemm])
    key = (tvm_ffi.structural_hash(func), side)
    if key not in _TILES:
        _TILES[key] = _tile_of(func, make_target("cuda"), side)
    return _TILES[key]


def _tile_of(func: tirx.PrimFunc, target, side: int | None) -> tuple[int, int] | None:
    try:
        done = default_schedule(func, target, STITCH_BLOCK, gemm_tile=side)
        stages = lower.lower_stage("gemm", done.func, target) if done.rule in _TILE_RULES else []
    except (ScheduleError, StitchError):
        return None
    # one launch region, its threads the rule's own (not, e.g., a tuned variant's)
    if len(stages) != 1 or _thread_count(stages[0]) != _TILE_RULES[done.rule] or GEMM_TILE_ATTR not in done.func.attrs:
        return None
    rows, cols = (int(e) for e in done.func.attrs[GEMM_TILE_ATTR])
    return rows, cols


def _thread_count(stage) -> int:
    return math.prod(e for _, e in stage.threads.values())


# the stitched GEMM rules whose blocks write one dense output tile each, and their threads
_TILE_RULES = {"Matmul": StitchedMatmul().threads, "TensorCoreMatmul": TensorCoreMatmul().threads}


def split_pays(candidate: Candidate, gpu: hardware.GPU | None = None,
               constants: latency.Constants = latency.FITTED) -> str | None:
    """None when the latency model predicts ``candidate`` faster split in two; else why it is kept,
    with both figures (an estimate).

    Both forms have the grid sync after the GEMM (before the combine, or before the row
    reduction), so they differ in two stages: split, the partials run in the GEMM's blocks
    (one tile each, ``lanes`` threads a tile row, their sums added on chip: a partial a tile
    row) and a combine reduces them,
    a row per block; whole, one row reduction per block reads the rows. Both run on a stitched
    kernel's resident blocks (256 threads, grid-stride). The split's first stage is priced as
    if it read the tile from global memory (an upper bound: stitched with its GEMM it reads the
    tile on chip)."""
    gpu = gpu or hardware.for_arch(str(make_target("cuda").attrs["arch"]))
    c = candidate
    tile_rows, tiles_a_row = c.tile[0], c.length // c.tile[1]
    parts = tiles_a_row
    row_bytes = c.rows * c.length * c.elem_bytes
    partial_bytes = c.partials * c.rows * parts * c.partial_bytes
    whole = [Stage(c.rows, STITCH_BLOCK, row_bytes + c.rows * c.partial_bytes, c.partials * c.rows * c.length)]
    split = [Stage(c.rows // tile_rows * tiles_a_row, tile_rows * c.lanes, row_bytes + partial_bytes,
                           c.partials * c.rows * c.length),
             Stage(c.rows, STITCH_BLOCK, partial_bytes + c.rows * c.partial_bytes, c.partials * c.rows * parts)]
    slots = gpu.sms * max(1, gpu.threads_per_sm // STITCH_BLOCK)

    def us(stages):
        return sum(latency.stage_time(gpu, constants, st, slots, persistent=True).seconds for st in stages) * 1e6
    whole_us, split_us = us(whole), us(split)
    if split_us < whole_us:
        return None
    return (f"the latency model predicts the split slower: {split_us:.1f} us for partials in the GEMM's "
            f"{split[0].tiles} tiles and a combine, {whole_us:.1f} us as one row reduction (estimate)")
