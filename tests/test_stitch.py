"""V3: subprograms stitched into ONE cooperative kernel with grid syncs; the static safety check."""

import re

import pytest

from tvm import tirx

from conftest import needs_nvcc, run_and_compare, zoo_but_slow
from souffle_tvm.cost import hardware
from souffle_tvm.pipeline import results as pipeline
from souffle_tvm.pipeline.options import Options
from souffle_tvm.stitch import check as stitch_check, kernel_ir, lower
from souffle_tvm.pipeline.driver import compile as compile_model
from souffle_tvm.frontend.importer import import_onnx
from souffle_tvm.core.targets import make_target
from souffle_tvm.errors import StitchError
from souffle_tvm.stitch.module import stitch_module


@pytest.fixture(scope="module")
def bert_v3():
    # 64-wide GEMM tiles, as the stage counts below assume: with tiles sized to the grid
    # (test_geometry) the 32 rows tile and the softmax splits in two phases too
    m = import_onnx("bert", small=True)
    return pipeline.run(m.mod, make_target("cuda"), m.params, Options(level="v3", partitioner="blocks", gemm_tile=64))


def test_bert_attention_block_is_one_kernel(bert_v3):
    # 2 layers x (attention block, FFN block): 4 cooperative kernels
    # hand-counted: each stage reads whole rows of the one before it, a grid sync apiece
    # (attention: 4 stages, 3 syncs; FFN: up GEMM, down GEMM, residual + LayerNorm, 2 syncs)
    assert [(len(k.stages), k.grid_syncs) for k in bert_v3.stitched] == [(4, 3), (3, 2)] * 2
    assert all(k.function for k in bert_v3.stitched)
    attention = bert_v3.stitched[0]
    # QKV GEMM, attention (Q K^T -> softmax -> P V: one row chain, no grid sync inside), out-proj,
    # residual + LayerNorm
    assert len(attention.stages) == 4
    assert attention.grid_syncs == 3 and attention.safety.ok
    funcs = [f for gv, f in bert_v3.mod.functions.items() if gv.name_hint.startswith("souffle_stitched")]
    assert len(funcs) >= 2


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_bert_v3_compiles_with_nvcc_and_fits(arch, tmp_path):
    # 64-wide GEMM tiles: with 16-wide ones (sized to the grid) ptxas spills 16 B on sm_80, and
    # the blocks partitioner does not act on ptxas feedback
    c = compile_model("bert", "cuda", "souffle", small=True, arch=arch, level="v3", partitioner="blocks",
                      gemm_tile=64)
    r = c.report
    # attention and FFN block of each layer; the second layer's kernels are the first's again
    assert r.launches == 4 and r.distinct_kernels == 2
    assert len(re.findall(r"__global__[^;{]*\{", c.cuda_source)) == 2
    gpu = hardware.for_arch(arch)
    for k in r.kernels:
        assert k.cooperative and k.block == [256, 1, 1] and k.grid[1:] == [1, 1]
        assert k.spill_bytes == 0 and k.max_coresident >= gpu.sms
        # the grid is what the stages can use, up to what the measured occupancy lets be co-resident
        assert k.grid[0] <= k.max_coresident and k.grid[0] > 1
    c.export_library(str(tmp_path / "b.so"))
    assert b"tirx.use_cooperative_launch" in (tmp_path / "b.so").read_bytes()


@pytest.mark.parametrize("name", zoo_but_slow("swin"))     # swin (~50 s) in make test-all
def test_every_small_model_v3_builds_with_fewer_launches(name):
    v2 = compile_model(name, "cuda", "souffle", small=True, level="v2", nvcc=False).report
    v3 = compile_model(name, "cuda", "souffle", small=True, level="v3", nvcc=False).report
    assert v3.launches < v2.launches
    # the subprograms cover every group once, in order, each cut with its reason; the model's end
    # is the last cut
    assert [i for sp in v3.subprograms for i in sp["indices"]] == list(range(len(v3.groups)))
    assert all(sp["reason"] for sp in v3.subprograms) and v3.subprograms[-1]["reason"] == "end of model"


@pytest.mark.parametrize("name", ["lstm", "mmoe"])
def test_paper_single_kernel_models(name):
    assert compile_model(name, "cuda", "souffle", small=True, level="v3", nvcc=False).report.launches == 1


def test_v3_cpu_twin_matches():
    c = compile_model("bert", "llvm", "souffle", small=True, level="v3")
    assert c.report.fusion == "souffle" and c.report.level == "v3" and c.report.fallback is None, c.report.fallback
    for cmp in run_and_compare(c):
        assert cmp.finite and cmp.rel_l2 < 1e-5, cmp


def _stitched_func(bert_v3):
    return next(f for gv, f in bert_v3.mod.functions.items() if gv.name_hint == "souffle_stitched_0")


def test_static_check_catches_a_removed_sync(bert_v3):
    func = _stitched_func(bert_v3)
    assert stitch_check.check(func, 132, 528).ok
    seq = kernel_ir.stage_loops(func)
    first_sync = next(i for i, s in enumerate(seq) if kernel_ir.is_grid_sync(s))
    broken = kernel_ir.replace_stages(func, seq[:first_sync] + seq[first_sync + 1:])
    problems = stitch_check.check(broken, 132, 528).problems
    assert problems and "no grid sync" in problems[0]


def test_static_check_catches_an_oversized_grid(bert_v3):
    problems = stitch_check.check(_stitched_func(bert_v3), 1000, 528).problems
    assert problems and "co-resident" in problems[0]


def test_static_check_catches_a_guarded_barrier(bert_v3):
    func = _stitched_func(bert_v3)
    seq = kernel_ir.stage_loops(func)
    tid = next(a.node.var for a in [func.body.body] if isinstance(a, tirx.AttrStmt))
    i = next(i for i, s in enumerate(seq) if kernel_ir.is_grid_sync(s))
    guarded = tirx.IfThenElse(tid < tirx.const(128, tid.ty), seq[i], None)
    problems = stitch_check.check(kernel_ir.replace_stages(func, seq[:i] + [guarded] + seq[i + 1:]), 132, 528).problems
    assert any("under a condition" in p for p in problems)


def test_occupancy_follows_the_documented_rules():
    h = hardware.GPUS["h200"]
    # 256 threads, 80 registers: 80*32 = 2560 regs per warp (already a multiple of 256), 8 warps
    # -> 20480 regs per block -> 65536 // 20480 = 3 blocks by registers
    occ = hardware.occupancy(h, 256, 80, 9924)
    assert (occ.blocks_per_sm, occ.limited_by) == (3, "registers")
    # 33 registers round up to 40 per thread (1280 per warp): 65536 // (1280*8) = 6
    assert hardware.occupancy(h, 256, 33, 0).blocks_per_sm == 6
    # shared memory: 100 KB + 1 KB reserved per block -> 233472 // 103424 = 2
    assert hardware.occupancy(h, 128, 16, 100 * 1024) == hardware.Occupancy(2, "shared memory")
    assert hardware.occupancy(h, 1024, 16, 0) == hardware.Occupancy(2, "threads")



def test_subprogram_cuts_have_reasons(bert_v3):
    from souffle_tvm.partition import groups as partition, subprograms

    groups = bert_v3.partition.groups
    readers = partition.readers_of(bert_v3.program)
    cuts = subprograms.by_normalization(groups, readers)
    assert [len(idx) for idx, _ in cuts] == [4, 3, 4, 3]
    assert all("normalisation" in why for _, why in cuts[:-1])
    capped = subprograms.by_normalization(groups, readers, max_groups=3)
    assert max(len(idx) for idx, _ in capped) == 3
    assert any(why.startswith("stage cap") for _, why in capped)
    refused = subprograms.by_normalization(groups, readers, ["test" if i == 2 else None for i in range(len(groups))])
    assert ([2], "not stitchable: test") in refused


def test_unstitchable_groups_stay_separate_kernels(monkeypatch):
    monkeypatch.setattr(lower, "why_not_stitchable", lambda f, t, b: "its schedule uses 512 threads per block")
    v2 = compile_model("mmoe", "cuda", "souffle", small=True, level="v2", nvcc=False).report
    v3 = compile_model("mmoe", "cuda", "souffle", small=True, level="v3", nvcc=False).report
    assert v3.launches == v2.launches
    assert all("512 threads" in sp["reason"] for sp in v3.subprograms)


@needs_nvcc
@pytest.mark.slow      # a known failure (strict xfail) costing 50-70 s of the default suite: make test-all
@pytest.mark.xfail(strict=True, reason=(
    "open since the latency model's fourth form (2026-12-03) changed small Swin's partition: its "
    "first build's grid of 512 makes ptxas take 250 registers (grid-stride loops of one trip fold "
    "away), so the kernels shrink to 132 blocks (48 registers, 5 blocks/SM would fit), and a second "
    "widening to 512 under __launch_bounds__(256, 4) spills; no small zoo model widens a grid now"))
def test_stitched_grid_grows_to_the_measured_coresident_limit():
    # Small Swin's first kernel has stages of 512 blocks, more than fit at once: the second build
    # launches exactly as many as the ptxas-measured occupancy lets be co-resident (one per SM was
    # the first build). (EfficientNet's were its depthwise convolutions, one block per output,
    # until SerialReduction gave them one output per thread.)
    r = compile_model("swin", "cuda", "souffle", small=True, level="v3").report
    gpu = hardware.for_arch("sm_90")
    widened = 0
    for k in (k for k in r.kernels if k.cooperative):    # (the last group may be a kernel of its own)
        occ = hardware.occupancy(gpu, k.block[0], k.registers, k.shared_bytes)   # 256, or the size chosen
        assert k.max_coresident == occ.blocks_per_sm * gpu.sms and k.grid[0] <= k.max_coresident
        widened += occ.blocks_per_sm > 1 and k.grid[0] == k.max_coresident
    assert widened >= 1


@needs_nvcc
def test_ptxas_feedback_splits_a_kernel_that_spills(monkeypatch):
    import dataclasses

    from souffle_tvm.build import ptxas as resources

    real, calls = resources.measure, []

    def first_build_spills(source, arch, timeout=600.0):
        out = real(source, arch, timeout)
        calls.append(1)
        if len(calls) == 1:     # the first build's stitched kernel "spills"; later builds are real
            out = {k: dataclasses.replace(v, spill_bytes=64) if k.startswith("souffle_stitched") else v
                   for k, v in out.items()}
        return out

    monkeypatch.setattr(resources, "measure", first_build_spills)
    r = compile_model("mmoe", "cuda", "souffle", small=True, level="v3").report
    assert r.launches >= 2
    assert any(sp["reason"].startswith("ptxas feedback: 64 B of register spills") for sp in r.subprograms)
    assert all(k.spill_bytes == 0 for k in r.kernels)


def test_stitching_refuses_a_subprogram_the_partitioner_should_not_have_drawn(bert_v3, monkeypatch):
    """Boundaries are the partitioner's alone: handed a stage it cannot stitch, the stitcher
    raises instead of silently drawing a cut of its own."""
    monkeypatch.setattr(lower, "why_not_stitchable", lambda f, t, b: "its schedule uses 512 threads per block")
    with pytest.raises(StitchError, match="cannot be stitched: its schedule uses 512"):
        stitch_module(bert_v3.unstitched, make_target("cuda"), [[0, 1]], grid=132)
