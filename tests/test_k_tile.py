"""The K tile of a stitched SIMT GEMM (``codegen.rules.StitchedMatmul``): dlight's 16, or 32 or 64
where the latency model predicts the tile's K loop, one global load's round trip and a barrier
per step, its critical path (few tiles, a long K: EfficientNet-B0's late 1x1 convolutions, 49
pixels x 192 channels x 1152 terms in 48 tiles), never at the cost of a resident block. The
schedules run on the CPU through the emulator and match numpy, ragged K included."""

import numpy as np
import pytest
import tvm
from tvm import te

from souffle_tvm.build.executable import device_counts
from souffle_tvm.codegen import schedule
from souffle_tvm.codegen.rules import StitchedMatmul
from souffle_tvm.codegen.rules.gemm_tiles import ContractionWork
from souffle_tvm.core.ir_names import GEMM_K_TILE_ATTR
from souffle_tvm.core.targets import make_target
from souffle_tvm.runtime import emulate

CUDA = make_target("cuda")
LLVM = make_target("llvm")


def _gemm(m: int, n: int, k: int):
    a, b = te.placeholder((m, k), name="A"), te.placeholder((k, n), name="B")
    r = te.reduce_axis((0, k), name="k")
    c = te.compute((m, n), lambda i, j: te.sum(a[i, r] * b[r, j], axis=r), name="C")
    return te.create_prim_func([a, b, c])


def _k_tile(func) -> int:
    return int(func.attrs[GEMM_K_TILE_ATTR])


def _k_steps(func) -> int:
    (counts,) = device_counts(func, CUDA)
    return counts.k_steps


def test_a_long_k_of_few_tiles_takes_fewer_longer_steps():
    func = _gemm(49, 192, 1152)
    chosen = schedule.schedule_group(func, CUDA, 256)
    fixed = schedule.schedule_group(func, CUDA, 256, gemm_k_tile=16)
    assert chosen.rule == "Matmul" and _k_tile(chosen.func) == 64 and _k_tile(fixed.func) == 16
    assert schedule.form_of(chosen.rule, 256, chosen.func) == "StitchedMatmul@256/k64"
    assert schedule.form_of(fixed.rule, 256, fixed.func) == "StitchedMatmul@256"
    # what a block of the built kernel waits on: 1152 / 64 steps instead of 1152 / 16
    assert (_k_steps(chosen.func), _k_steps(fixed.func)) == (18, 72)
    with CUDA:
        rule = StitchedMatmul()
        assert rule.predicted_seconds(func, chosen.func, CUDA) < rule.predicted_seconds(func, fixed.func, CUDA)


def test_a_given_k_tile_is_kept():
    done = schedule.schedule_group(_gemm(49, 192, 1152), CUDA, 256, gemm_k_tile=32)
    assert _k_tile(done.func) == 32 and _k_steps(done.func) == 36


def test_no_step_longer_than_the_contraction():
    """K = 24: a 32- or 64-term step would load padding only; dlight's 16 it is."""
    with CUDA:
        assert StitchedMatmul()._k_tiles(24) == (16,)
        assert StitchedMatmul()._k_tiles(1152) == (16, 32, 64)
        assert StitchedMatmul(k_tile=64)._k_tiles(24) == (64,)
    assert _k_tile(schedule.schedule_group(_gemm(49, 192, 24), CUDA, 256).func) == 16


def test_a_longer_step_never_costs_a_resident_block_or_dynamic_shared_memory():
    """At 512 threads a 64 x 128 fp32 tile's 64-term slices are 64 KB (past the 48 KB a kernel
    declares statically), its 32-term ones 32 KB; dlight's own 16 is always allowed. At 128
    threads, six blocks of a 32 x 64 tile share an SM: their 64-term slices (16 KB a block) fit."""
    work = ContractionWork(flops=2 * 1024 ** 3, bytes=0, written=0, elem_bytes=4)
    wide = StitchedMatmul(threads=512)
    assert not wide._fits(4, 64, 1000, work, CUDA)
    assert wide._fits(4, 32, 1000, work, CUDA) and wide._fits(4, 16, 1000, work, CUDA)
    assert StitchedMatmul(threads=128)._fits(4, 64, 1000, work, CUDA)
    # fp16 slices are half: the 64-term step fits at 512 threads too
    assert wide._fits(4, 64, 1000, ContractionWork(work.flops, 0, 0, 2), CUDA)
    # priced on 8 blocks of 256 threads an SM (a kernel alone), 64 x 64 tiles' 64-term slices
    # (32 KB a block) would leave room for 6 of them: refused; on a stitched kernel's 3, kept
    assert StitchedMatmul()._fits(4, 64, 8 * 132, work, CUDA)
    assert not StitchedMatmul(slots=8 * 132)._fits(4, 64, 8 * 132, work, CUDA)
    assert StitchedMatmul(slots=8 * 132)._fits(4, 32, 8 * 132, work, CUDA)


def _emulated(func, a, b):
    ex = tvm.compile(tvm.IRModule({"k": emulate.emulate_primfunc(func, CUDA, "k")}), target=LLVM)
    out = tvm.runtime.tensor(np.full((a.shape[0], b.shape[1]), np.nan, "float32"))
    ex["k"](tvm.runtime.tensor(a), tvm.runtime.tensor(b), out)
    return out.numpy()


@pytest.mark.parametrize("k_tile", [32, 64])
@pytest.mark.parametrize("m,n,k", [(49, 70, 200), (64, 64, 256)], ids=["ragged", "exact"])
def test_longer_steps_compute_the_same_product(m, n, k, k_tile):
    """Emulated on the CPU with GPU semantics (threads statement by statement between barriers):
    ragged M, N and K (200 = 3 x 64 + 8) included."""
    func = _gemm(m, n, k)
    with CUDA:
        done = StitchedMatmul(k_tile=k_tile, micro=2).apply(func, CUDA, False).mod["main"]
    assert _k_tile(done) == k_tile
    rng = np.random.default_rng(k + k_tile)
    a = rng.standard_normal((m, k)).astype("float32")
    b = rng.standard_normal((k, n)).astype("float32")
    want = (a.astype("float64") @ b.astype("float64"))
    got = _emulated(done, a, b)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5
