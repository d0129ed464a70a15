"""Stage geometry (issue 17, item 4): a stitched GEMM stage's tile is sized to the kernel's grid.

``codegen.rules.StitchedMatmul`` schedules a GEMM at 64-, 32- and 16-wide tiles of 16 x 16 threads and
keeps the one the latency model predicts fastest on the kernel's resident blocks: the tile
count that fills them in whole waves, the largest tile (most operand reuse) among equals."""

import pytest
from tvm import te

from souffle_tvm.codegen import schedule
from souffle_tvm.codegen.rules.gemm_tiles import block_count, predicted_blocks
from souffle_tvm.codegen.rules.stitched_matmul import StitchedMatmul
from souffle_tvm.core.ir_names import GEMM_TILE_ATTR
from souffle_tvm.core.targets import make_target
from souffle_tvm.errors import OptionsError
from souffle_tvm.pipeline.options import Options

CUDA = make_target("cuda")


def _gemm(m: int, n: int, k: int, epilogue: bool = False):
    a, b = te.placeholder((m, k), name="A"), te.placeholder((k, n), name="B")
    r = te.reduce_axis((0, k), name="k")
    c = te.compute((m, n), lambda i, j: te.sum(a[i, r] * b[r, j], axis=r), name="C")
    if not epilogue:
        return te.create_prim_func([a, b, c])
    bias = te.placeholder((n,), name="bias")
    d = te.compute((m, n), lambda i, j: te.max(c[i, j] + bias[j], 0.0), name="D")
    return te.create_prim_func([a, b, bias, d])


def _chosen(func, slots: int) -> tuple[int, int]:
    with CUDA:
        out = StitchedMatmul(slots=slots).apply(func, CUDA, False).mod["main"]
    return int(out.attrs[GEMM_TILE_ATTR][0]), block_count(out)


@pytest.mark.parametrize("slots,side", [(64, 64), (256, 32), (1024, 16)])
def test_the_tile_count_fills_the_grid_in_whole_waves(slots, side):
    """512 x 512 x 512: 64, 256 or 1024 tiles (64-, 32-, 16-wide). On 64 resident blocks the
    64-wide tiles are one whole wave; on 256 the 32-wide; on 1024 the 16-wide."""
    assert _chosen(_gemm(512, 512, 512), slots) == (side, slots)


def test_the_choice_is_the_models_fastest():
    func = _gemm(128, 256, 256)
    with CUDA:
        times = {m * 16: StitchedMatmul(slots=396).predicted_seconds(func, StitchedMatmul(micro=m).apply(func, CUDA, False)
                                                                 .mod["main"], CUDA) for m in (4, 2, 1)}
    side, _ = _chosen(func, 396)
    assert times[side] == min(times.values())
    assert side == 16       # 8 tiles of 64 would leave 388 of 396 blocks idle


def test_a_fused_epilogue_does_not_change_the_tile():
    """A two-phase partial shares the tile ``gemm_tile`` computes for the GEMM alone."""
    for slots in (64, 256, 1024):
        assert _chosen(_gemm(512, 512, 512, epilogue=True), slots)[0] == _chosen(_gemm(512, 512, 512), slots)[0]


def test_the_tile_can_be_fixed():
    done = schedule.schedule_group(_gemm(128, 256, 256), CUDA, 256, gemm_tile=64)
    assert done.rule == "Matmul" and [int(e) for e in done.func.attrs[GEMM_TILE_ATTR]] == [64, 64] and block_count(done.func) == 8
    with pytest.raises(OptionsError, match="unknown GEMM tile 48"):
        Options(level="v3", gemm_tile=48).check(CUDA)


def _batched_nt(batch: int, m: int, n: int, k: int):
    """A[b, m, k] x B[b, n, k]^T, the attention form (B read transposed)."""
    a, b = te.placeholder((batch, m, k), name="A"), te.placeholder((batch, n, k), name="B")
    r = te.reduce_axis((0, k), name="k")
    c = te.compute((batch, m, n), lambda s, i, j: te.sum(a[s, i, r] * b[s, j, r], axis=r), name="C")
    return te.create_prim_func([a, b, c])


@pytest.mark.parametrize("func", [_gemm(512, 512, 512), _gemm(100, 1000, 2048), _gemm(49, 70, 33, epilogue=True),
                                  _batched_nt(12, 128, 128, 64), _batched_nt(3, 50, 17, 40)],
                         ids=["square", "ragged", "epilogue", "attention", "small-batched"])
def test_the_tile_count_is_known_before_scheduling(func):
    """The rule schedules only the tile it predicts fastest, from counts read off the unscheduled
    contraction; each must be the count dlight's schedule launches."""
    for micro in (4, 2, 1):
        with CUDA:
            out = StitchedMatmul(micro=micro).apply(func, CUDA, False).mod["main"]
        assert predicted_blocks(func, 16 * micro) == block_count(out)


def test_no_count_for_what_is_not_a_gemm():
    a = te.placeholder((64, 64), name="A")
    b = te.compute((64, 64), lambda i, j: a[i, j] * 2.0, name="B")
    assert predicted_blocks(te.create_prim_func([a, b]), 64) is None
