"""Register caps: a stitched kernel whose registers alone hold its blocks per SM down gets
``__launch_bounds__(threads, blocks)`` where the latency model predicts the extra block per SM
faster, and keeps it only if ptxas then spills no more (pipeline.feedback)."""

import dataclasses
from types import SimpleNamespace

import pytest
import tvm
from tvm import tirx
from tvm.script import tirx as T

from souffle_tvm.build import ptxas
from souffle_tvm.build.cooperative import COOPERATIVE_TIR_PIPELINE
from souffle_tvm.cost.hardware import GPUS, occupancy
from souffle_tvm.core.ir_names import MIN_BLOCKS_ATTR
from souffle_tvm.errors import StitchError
from souffle_tvm.pipeline import feedback
from souffle_tvm.build.facts import BuildFacts, KernelFacts, PlannedStage
from souffle_tvm.cost.work import Stage
from souffle_tvm.pipeline.building import cuda_source
from souffle_tvm.planning.register_caps import register_cap, register_caps
from conftest import needs_nvcc

H200 = GPUS["h200"]


@pytest.mark.parametrize("blocks, regs", [(1, 255), (2, 128), (3, 80), (4, 64), (6, 40), (8, 32)])
def test_the_cap_is_what_leaves_room_for_that_many_blocks(blocks, regs):
    # 256 threads = 8 warps; registers go in 256-register warp units of a 64K file
    assert register_cap(H200, 256, blocks) == regs
    assert occupancy(H200, 256, regs, 0).blocks_per_sm >= blocks
    if regs < 255:
        assert occupancy(H200, 256, regs + 8, 0).blocks_per_sm < blocks


def _rows():
    """A float32 parameter of 4096 rows of 96 (a helper keeps pyflakes off TVMScript's dtype strings)."""
    return T.Buffer((4096, 96), "float32")


@T.prim_func
def _hungry(A: _rows(), B: _rows()):
    # 96 live accumulators per thread: ptxas wants about 100 registers
    T.func_attr({"global_symbol": "hungry", "tirx.noalias": True, "tirx.is_scheduled": True})
    bx = T.launch_thread("blockIdx.x", 16)
    tx = T.launch_thread("threadIdx.x", 256)
    acc = T.alloc_buffer((96,), "float32", scope="local")
    for j in T.unroll(96):
        acc[j] = A[bx * 256 + tx, j]
    for _ in range(8):
        for j in T.unroll(96):
            acc[j] = acc[j] * acc[(j + 1) % 96] + T.float32(1)
    for j in T.unroll(96):
        B[bx * 256 + tx, j] = acc[j]


@needs_nvcc
def test_the_build_turns_the_attribute_into_launch_bounds_and_ptxas_obeys():
    def compiled(func):
        ex = tvm.compile(tvm.IRModule({"hungry": func}), target=tvm.target.Target({"kind": "cuda", "arch": "sm_90"}),
                         tir_pipeline=COOPERATIVE_TIR_PIPELINE)
        src = cuda_source(ex)
        return src, ptxas.measure(src, "sm_90")["hungry_kernel"]

    src, free = compiled(_hungry)
    assert "__launch_bounds__(256)" in src and free.registers > 64
    src, capped = compiled(_hungry.with_attr(MIN_BLOCKS_ATTR, tirx.const(4, "int32")))
    assert "__launch_bounds__(256, 4)" in src
    assert capped.registers <= 64 and capped.spill_bytes > 0    # what the feedback must then refuse


def _row(registers, shared, tiles):
    stage = PlannedStage(Stage(tiles, 256, tiles * 64 * 1024, 0))
    return KernelFacts("souffle_stitched_0_kernel", "souffle_stitched_0", [396, 1, 1], [256, 1, 1], registers,
                       shared, 0, 1, 0, 0, stages=["a", "b"], grid_syncs=1, cooperative=True,
                       stage_plan=[stage, stage])


def _caps(row, max_blocks):
    facts = BuildFacts("m", "cuda", "sm_90", [row], 1, 0.0)
    stitched = [SimpleNamespace(function="souffle_stitched_0", stages=["a", "b"], max_blocks=max_blocks)]
    return register_caps(facts, stitched, "sm_90")


def test_a_register_bound_kernel_with_tiles_to_spare_is_offered_a_cap():
    # 80 registers: 3 blocks of 256 per SM (396 slots) for stages of 1056 tiles: 3 waves; capped
    # at 64 registers, 4 blocks (528 slots) run them in 2
    caps = _caps(_row(80, 11844, 1056), max_blocks=1056)
    assert list(caps) == ["souffle_stitched_0"]
    blocks, grid, why = caps["souffle_stitched_0"]
    assert (blocks, grid) == (4, 528) and "at most 64 registers" in why
    # 450 tiles: 396 blocks leave a second wave of 54, 4 per SM run them at once, on 450 blocks
    (blocks, grid, _), = _caps(_row(80, 11844, 450), max_blocks=450).values()
    assert (blocks, grid) == (4, 450)


def test_no_cap_where_shared_memory_or_the_tiles_hold_the_blocks_down():
    # shared memory allows 2 blocks per SM whatever the registers
    assert _caps(_row(80, 100_000, 1056), max_blocks=1056) == {}
    # no stage has more tiles than the 396 blocks already resident: a larger grid would idle
    assert _caps(_row(80, 11844, 396), max_blocks=396) == {}
    # a kernel that spills already is the splitter's business, not the cap's
    assert _caps(dataclasses.replace(_row(80, 11844, 1056), spill_bytes=64), max_blocks=1056) == {}


@pytest.mark.slow
@needs_nvcc
def test_a_cap_that_makes_ptxas_spill_is_not_kept():
    # small Swin at v3: two stitched kernels at 80 registers (3 blocks per SM) are offered 64;
    # ptxas then spills, so the build without caps is the one returned
    from souffle_tvm.pipeline.driver import compile as compile_model

    tried = []
    build = feedback.build

    def recording(*args, **kwargs):
        out = build(*args, **kwargs)
        tried.append("__launch_bounds__(256, 4)" in (out[2] or ""))
        return out

    mp = pytest.MonkeyPatch()
    mp.setattr(feedback, "build", recording)
    try:
        report = compile_model("swin", "cuda", "souffle", small=True, level="v3").report
    finally:
        mp.undo()
    assert tried[-1] and not any(tried[:-1])
    stitched = [k for k in report.kernels if k.cooperative]
    assert stitched and all(k.min_blocks is None and not k.spill_bytes for k in stitched)


@needs_nvcc
def test_a_cap_that_pays_is_built_into_the_kernel(monkeypatch):
    # planted: the small MMoE's stitched kernel offered a cap of 6 blocks per SM (at most 40
    # registers: no spill), and the model told it pays. Its 32 registers hold 8 blocks of 256
    # per SM already (one grid sync since one-block stages need none), so the offer is planted too
    from souffle_tvm.pipeline.driver import compile as compile_model

    monkeypatch.setattr(feedback, "one_more_block", lambda gpu, row: True)
    monkeypatch.setattr(feedback, "register_caps", lambda report, stitched, arch: {
        k.function: (6, k.grid, "planted") for k in stitched if len(k.stages) > 1})
    monkeypatch.setattr(feedback, "graph_seconds",
                        lambda planned: 0.0 if any(k.min_blocks for k in planned.kernels) else 1.0)
    compiled = compile_model("mmoe", "cuda", "souffle", small=True, level="v3")
    (kernel,) = [k for k in compiled.report.kernels if k.cooperative]
    assert kernel.min_blocks == 6 and kernel.registers <= 40 and not kernel.spill_bytes
    assert "__launch_bounds__(256, 6)" in compiled.cuda_source


@needs_nvcc
def test_a_capped_build_that_fails_leaves_the_build_it_had(monkeypatch):
    # planted: a cap is proposed and the restitch with it raises: the compile goes on uncapped
    from souffle_tvm.pipeline.driver import compile as compile_model

    monkeypatch.setattr(feedback, "register_caps", lambda report, stitched, arch: {
        k.function: (6, k.grid, "planted") for k in stitched if len(k.stages) > 1})
    restitch = feedback.restitch

    def failing(souffle, target, fb):
        if fb.min_blocks:
            raise StitchError("planted")
        return restitch(souffle, target, fb)

    monkeypatch.setattr(feedback, "restitch", failing)
    compiled = compile_model("mmoe", "cuda", "souffle", small=True, level="v3")
    (kernel,) = [k for k in compiled.report.kernels if k.cooperative]
    assert kernel.min_blocks is None and "__launch_bounds__(256, " not in compiled.cuda_source


@needs_nvcc
def test_a_grid_the_settled_build_leaves_room_for_is_launched_under_a_cap(monkeypatch):
    # planted: the small MMoE's first build's figures are told to allow one block (as BERT-base's
    # v3 kernel, 178 registers at its 288 blocks: one block per SM), so it settles at one; the
    # settled build's own figures allow its full grid (as BERT's at 132 blocks: 79 registers),
    # and the model says the wider grid pays: it is built at that grid, under the register cap
    # that keeps it co-resident
    from souffle_tvm.pipeline.driver import compile as compile_model

    coresident = feedback.coresident_grids
    calls = []

    def one_block_first(facts, souffle):
        calls.append(1)
        return {k.function: 1 for k in souffle.stitched} if len(calls) == 1 else coresident(facts, souffle)

    monkeypatch.setattr(feedback, "coresident_grids", one_block_first)
    monkeypatch.setattr(feedback, "graph_seconds", lambda planned: 0.0 if any(
        k.cooperative and k.grid[0] > 1 for k in planned.kernels) else 1.0)
    compiled = compile_model("mmoe", "cuda", "souffle", small=True, level="v3")
    (kernel,) = [k for k in compiled.report.kernels if k.cooperative]
    assert kernel.grid[0] > 1 and kernel.min_blocks == 1 and not kernel.spill_bytes
    assert "__launch_bounds__(256, 1)" in compiled.cuda_source
    # and where the model does not say it pays, the settled grid stays
    calls.clear()
    monkeypatch.setattr(feedback, "graph_seconds", lambda planned: 1.0)
    compiled = compile_model("mmoe", "cuda", "souffle", small=True, level="v3")
    (kernel,) = [k for k in compiled.report.kernels if k.cooperative]
    assert kernel.grid[0] == 1 and kernel.min_blocks is None
