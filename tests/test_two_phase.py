"""Two-phase reductions after a GEMM (softmax, LayerNorm) and the barrier proof that makes the
first phase block-local: numerics on the CPU twin and on the emulated stitched kernel, the
barriers placed, and planted faults caught."""

import re

import pytest
import tvm
import tvm_ffi
from tvm import tirx

from conftest import needs_nvcc, run_and_compare
from souffle_tvm.stitch import dependence
from souffle_tvm.runtime import emulate
from souffle_tvm.frontend import importer as frontend
from souffle_tvm.pipeline import results as pipeline
from souffle_tvm.pipeline.options import Options
from souffle_tvm.planning.partials import gemm_tile
from souffle_tvm.runtime import runner
from souffle_tvm.stitch import check as stitch_check, kernel_ir
from souffle_tvm.te import program as te_program
from souffle_tvm.pipeline.driver import compile as compile_model
from souffle_tvm.core.targets import make_target
from souffle_tvm.transforms import horizontal, two_phase, vertical
from souffle_tvm.transforms.two_phase import partial_lanes
from souffle_tvm.zoo.builder import GraphBuilder

CUDA = make_target("cuda")
KINDS = ["softmax", "layernorm"]


def gemm_then(kind: str, rows: int = 128, d: int = 256, dtype: str = "float32"):
    """x @ W + b + r followed by a softmax or a LayerNorm over the last axis."""
    g = GraphBuilder(f"gemm_{kind}", dtype=dtype)
    x, r = g.input("x", [1, rows, d]), g.input("r", [1, rows, d])
    y = g.op("Add", [g.linear(x, d, d), r])
    y = g.op("Softmax", [y], axis=-1) if kind == "softmax" else g.layer_norm(y, d)
    g.output(y, [1, rows, d])
    return g.model()


def _program(model, dtype: str = "float32"):
    m = frontend.import_onnx(model, dtype=dtype)
    prog = te_program.lower(m.mod, weight_values=m.params)
    return vertical(horizontal(prog).program).program


@pytest.mark.parametrize("kind,forms", [("softmax", {"T_softmax_maxelem": "max", "T_softmax_expsum": "sum-exp"}),
                                        ("layernorm", {"T_add_sum": "sum", "T_add_var_sum": "sum-sq"})])
def test_reductions_after_a_gemm_are_split(kind, forms):
    prog = _program(gemm_then(kind))
    res = two_phase(prog, gemm_tile)
    assert res.split == forms
    # the GEMM's schedule sizes its tile to the stitched grid (test_geometry): 128 x 256 -> 16 wide
    side = gemm_tile(next(t for t in prog.stages() if t.op.name == "matmul"))[1]
    partials = [t for t in res.program.stages() if t.op.tag == "souffle_partial"]
    assert side == 16 and len(partials) == 2 and all([int(d) for d in t.shape] == [1, 128, 256 // side]
                                                     for t in partials)


def test_rows_that_do_not_tile_are_kept_with_the_reason():
    def tile64(gemm):
        return gemm_tile(gemm, 64)
    res = two_phase(_program(gemm_then("layernorm", rows=96)), tile64)
    assert not res.split and res.kept and all("96 rows are not a whole number of 64-row GEMM tiles" in why
                                              for why in res.kept.values())
    res = two_phase(_program(gemm_then("layernorm", d=64)), tile64)     # one 64-column tile per row
    assert not res.split and res.kept and all("rows of 64 are not two or more 64-column" in why
                                              for why in res.kept.values())


def test_the_transform_decides_from_the_predicate_it_is_handed():
    """two_phase is pure: whether a GEMM's tiles can be shared is the caller's answer."""
    prog = _program(gemm_then("softmax"))
    asked = []
    res = two_phase(prog, lambda gemm: asked.append(gemm.op.name))
    assert asked and not res.split
    assert all("not scheduled in tiles a partial can share" in why for why in res.kept.values())
    assert two_phase(prog, lambda gemm: (64, 64)).split
    # the partials take the tile they are handed: 32 rows per block, 4 tiles of 64 columns a
    # row, each row of a tile shared by 8 lanes (the block's 256 threads over its 32 rows), whose
    # sums meet on chip: 4 partials a row, one a tile
    res = two_phase(prog, lambda gemm: (32, 64))
    partials = [t for t in res.program.stages() if t.op.tag == "souffle_partial"]
    assert {(int(t.op.attrs["souffle_partial_rows"]), int(t.op.attrs["souffle_partial_tile"]),
             int(t.op.attrs["souffle_partial_lanes"])) for t in partials} == {(32, 64, 8)}
    assert all([int(d) for d in t.shape] == [1, 128, 4] for t in partials)


@pytest.mark.parametrize("tile,lanes", [((64, 128), 4), ((32, 64), 8), ((64, 64), 4), ((16, 16), 1),
                                        ((128, 128), 2), ((16, 256), 16), ((256, 64), 1), ((64, 8), 1),
                                        ((48, 64), 1), ((1, 1024), 1)])
def test_the_lanes_of_a_tile_row(tile, lanes):
    """The block's threads over the tile's rows, each lane reducing at least 4 columns; else one
    thread a row (the lanes' sums meet behind a barrier: a stage that fills the block)."""
    assert partial_lanes(tile) == lanes


@pytest.fixture(scope="module", params=KINDS)
def stitched(request):
    m = frontend.import_onnx(gemm_then(request.param))
    return m, pipeline.run(m.mod, CUDA, m.params, Options(level="v3"))


def _assert_emulated_matches(m, s, reverse: bool = False):
    """The stitched CUDA module ``s`` of model ``m``, run through the GPU-semantics emulator."""
    ex = tvm.compile(emulate.emulate_module(s.mod, CUDA, reverse=reverse), target=make_target("llvm"))
    feeds = runner.random_inputs(m.inputs, 0)
    outs = runner.run_vm(ex, s.params, runner.check_feeds(m.inputs, feeds))
    _, ref = runner.reference_outputs(m.onnx_model, feeds)
    for cmp in runner.compare(m.outputs, outs, ref):
        assert cmp.finite and cmp.rel_l2 < 1e-5, cmp


def _barriers(func):
    """The stitched body's top level: stages, barriers, and the on-chip channels it allocates."""
    return ["grid" if kernel_ir.is_grid_sync(s) else "block" if dependence.is_block_barrier(s)
            else "onchip" if isinstance(s, tirx.AllocBuffer) else "stage" for s in kernel_ir.stage_loops(func)]


def test_partials_run_in_the_gemm_blocks_with_one_grid_sync(stitched):
    _, s = stitched
    (k,) = s.stitched
    # the GEMM's tile on chip | GEMM | block barrier | both partials (one stage) | grid sync |
    # combine + normalise (stitch.channel)
    assert _barriers(s.mod[k.name]) == ["onchip", "stage", "block", "stage", "grid", "stage"]
    assert k.grid_syncs == 1 and k.safety.ok


@pytest.mark.parametrize("reverse", [False, True])
def test_emulated_kernel_matches_the_reference(stitched, reverse):
    m, s = stitched
    _assert_emulated_matches(m, s, reverse)


@pytest.mark.parametrize("kind", KINDS)
def test_cpu_twin_matches(kind):
    for cmp in run_and_compare(compile_model(gemm_then(kind), "llvm", "souffle", level="v3")):
        assert cmp.rel_l2 < 1e-5, cmp


def test_a_removed_block_barrier_is_caught(stitched):
    _, s = stitched
    func = s.mod[s.stitched[0].name]
    seq = kernel_ir.stage_loops(func)
    broken = kernel_ir.replace_stages(func, [x for x in seq if not dependence.is_block_barrier(x)])
    problems = stitch_check.check(broken, 8, 528).problems
    assert problems and "no block barrier" in problems[0]


def test_a_partial_reading_the_next_blocks_tile_needs_a_grid_sync(stitched):
    # the proof on the GEMM's output in global memory (with the on-chip channel a block holds
    # only its own tile: no index can reach the next one)
    m, _ = stitched
    s = pipeline.run(m.mod, CUDA, m.params, Options(level="v3", onchip=False))
    func = s.mod[s.stitched[0].name]
    bid, grid = kernel_ir.launch_var(func, "blockIdx.x")
    tid, _ = kernel_ir.launch_var(func, "threadIdx.x")
    loops = [x for x in kernel_ir.stage_loops(func) if isinstance(x, tirx.For)]
    gemm, part = (kernel_ir.stage_view(x, bid, tid, grid) for x in loops[:2])
    buf = next(p for p in func.params if p.name == "matmul")
    assert dependence.barrier_needed(gemm, buf, part, buf) == dependence.BLOCK
    one = tirx.const(1, "int64")
    shifted = dependence.StageView(tvm_ffi.structural_map(part.body, (tirx.Var, lambda v: dependence.VB + one
                                                                      if v.same_as(dependence.VB) else v)),
                                   part.tid, part.blocks - 1, part.threads)
    assert dependence.barrier_needed(gemm, buf, shifted, buf) == dependence.GRID


@needs_nvcc
def test_two_phase_kernel_compiles_with_nvcc():
    c = compile_model(gemm_then("layernorm"), "cuda", "souffle", level="v3")
    (k,) = c.report.kernels
    assert k.cooperative and k.spill_bytes == 0 and k.grid[0] <= k.max_coresident
    assert c.cuda_source.count("__syncthreads()") >= 1


# -- dynamic shared memory above 48 KB for GEMM stages -------------------------------------------
def _gemm_func():
    from souffle_tvm.codegen import emit
    from souffle_tvm.partition import groups as partition

    mm = next(t for t in _program(gemm_then("layernorm")).stages() if t.op.name == "matmul")
    return emit.group_primfunc(partition.Group([mm]), [mm])[0]


def _scopes(func):
    text = func.script()
    return {scope for scope in ("shared", "shared.dyn") if f'"{scope}"' in text}


def test_gemm_tiles_over_48kb_go_to_dynamic_shared_memory():
    from souffle_tvm.codegen import schedule

    small = schedule.schedule_group(_gemm_func(), CUDA, 256, gemm_tile=64)        # K tile 16: 8.7 KB
    big = schedule.schedule_group(_gemm_func(), CUDA, 256, gemm_k_tile=128, gemm_tile=64)  # 2 x 64 x 130 x 4 B
    assert small.rule == big.rule == "Matmul"
    assert "shared" in _scopes(small.func) and "shared.dyn" not in _scopes(small.func)
    assert "shared.dyn" in _scopes(big.func) and "shared" not in _scopes(big.func)


def test_occupancy_counts_dynamic_shared_memory_and_its_opt_in_limit():
    from souffle_tvm.cost import hardware

    h = hardware.GPUS["h200"]
    # 66944 B + 1 KB reserved per block: 233472 // 67968 = 3 blocks by shared memory
    assert hardware.occupancy(h, 256, 32, 66944) == hardware.Occupancy(3, "shared memory")
    assert hardware.occupancy(h, 256, 32, h.smem_per_block_optin + 1).blocks_per_sm == 0


@needs_nvcc
def test_stitched_kernel_with_dynamic_shared_memory_compiles_and_fits():
    from souffle_tvm.cost import hardware

    c = compile_model(gemm_then("layernorm"), "cuda", "souffle", level="v3", gemm_k_tile=128, gemm_tile=64)
    (k,) = c.report.kernels
    assert "extern __shared__" in c.cuda_source
    assert k.shared_bytes > 48 * 1024 and k.spill_bytes == 0 and k.cooperative
    occ = hardware.occupancy(hardware.for_arch("sm_90"), 256, k.registers, k.shared_bytes)
    assert k.max_coresident == occ.blocks_per_sm * 132 and k.grid[0] <= k.max_coresident


def test_emulated_kernel_with_dynamic_shared_memory_matches():
    m = frontend.import_onnx(gemm_then("layernorm"))
    s = pipeline.run(m.mod, CUDA, m.params, Options(level="v3", gemm_k_tile=128, gemm_tile=64))
    _assert_emulated_matches(m, s)


# -- the atomic form -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def atomic_layernorm():
    m = frontend.import_onnx(gemm_then("layernorm"))
    return m, pipeline.run(m.mod, CUDA, m.params, Options(level="v3", reduction="atomic"))


def test_atomic_form_sums_with_atomics_and_keeps_max_deterministic(atomic_layernorm):
    _, s = atomic_layernorm
    assert s.two_phase.split == {"T_add_sum": "sum (atomic)", "T_add_var_sum": "sum-sq (atomic)"}
    m = frontend.import_onnx(gemm_then("softmax"))
    soft = pipeline.run(m.mod, CUDA, m.params, Options(level="v3", reduction="atomic"))
    assert soft.two_phase.split == {"T_softmax_maxelem": "max", "T_softmax_expsum": "sum-exp"}


def test_atomic_kernel_zero_fills_first_and_syncs_before_readers(atomic_layernorm):
    _, s = atomic_layernorm
    (k,) = s.stitched
    func = s.mod[k.function]
    seq = kernel_ir.stage_loops(func)
    assert k.safety.ok and dependence.atomic_targets(func.body)
    # the two zero fills were hoisted ahead of the GEMM; adds and readers each behind a grid sync
    assert _barriers(func) == ["onchip", "stage", "stage", "stage", "grid", "stage", "stage", "grid", "stage"]
    assert not dependence.atomic_targets(seq[1]) and not dependence.atomic_targets(seq[2])


@pytest.mark.parametrize("reverse", [False, True])
def test_atomic_kernel_emulated_matches(atomic_layernorm, reverse):
    m, s = atomic_layernorm
    _assert_emulated_matches(m, s, reverse)


def _problems_without_grid_sync(souffle, which: int) -> list[str]:
    """The static check's findings on the first stitched kernel with its ``which``-th grid sync removed."""
    func = souffle.mod[souffle.stitched[0].function]
    seq = kernel_ir.stage_loops(func)
    syncs = [i for i, x in enumerate(seq) if kernel_ir.is_grid_sync(x)]
    return stitch_check.check(kernel_ir.replace_stages(func, seq[:syncs[which]] + seq[syncs[which] + 1:]), 8, 528).problems


def test_a_reader_of_atomic_sums_without_a_grid_sync_is_caught(atomic_layernorm):
    problems = _problems_without_grid_sync(atomic_layernorm[1], -1)
    assert problems and "no grid sync" in problems[0]


def test_atomic_form_is_a_cuda_option():
    m = frontend.import_onnx(gemm_then("layernorm"))
    with pytest.raises(ValueError, match="CUDA option"):
        pipeline.run(m.mod, make_target("llvm"), m.params, Options(level="v3", reduction="atomic"))


@needs_nvcc
def test_atomic_kernel_compiles_with_nvcc():
    c = compile_model(gemm_then("layernorm"), "cuda", "souffle", level="v3", reduction="atomic")
    assert "atomicAdd(" in c.cuda_source
    # (on sm_90 ptxas spills 56 B in the kernel with the GEMM: the feedback splits the GEMM off)
    assert all(k.spill_bytes == 0 for k in c.report.kernels)
    coop = [k for k in c.report.kernels if k.cooperative]
    assert coop and all(k.grid[0] <= k.max_coresident for k in coop)


def test_atomics_racing_their_zero_fill_are_caught(atomic_layernorm):
    problems = _problems_without_grid_sync(atomic_layernorm[1], 0)
    assert any("atomic_sum" in p and "no grid sync" in p for p in problems), problems


# -- tensor-core GEMMs (fp16): partials in the tensor-core rule's tiles ---------------------------
def test_fp16_reductions_split_in_the_tensor_core_tiles():
    """An fp16 GEMM gets the tensor-core schedule, whose tile is sized to the stitched grid: the
    128 x 256 GEMM's 32 x 64 tiles (16 blocks; 64 x 128 would give 4) are the smallest the rule
    has. The partials take that tile: 32 rows per block, 64 columns each (4 per 256-wide row)."""
    prog = _program(gemm_then("layernorm", dtype="float16"), "float16")
    mm = next(t for t in prog.stages() if t.op.name == "matmul")
    assert gemm_tile(mm) == (32, 64)
    res = two_phase(prog, gemm_tile)
    assert res.split == {"T_add_sum": "sum", "T_add_var_sum": "sum-sq"}
    partials = [t for t in res.program.stages() if t.op.tag == "souffle_partial"]
    assert len(partials) == 2 and all([int(d) for d in t.shape] == [1, 128, 4] for t in partials)
    assert {(int(t.op.attrs["souffle_partial_rows"]), int(t.op.attrs["souffle_partial_tile"])) for t in partials} \
        == {(32, 64)}


@pytest.fixture(scope="module", params=["deterministic", "atomic"])
def fp16_stitched(request):
    """GEMM -> LayerNorm in fp16 (the LayerNorm's sums in fp32), stitched at v3 in either form."""
    m = frontend.import_onnx(gemm_then("layernorm", dtype="float16"), dtype="float16")
    return request.param, m, pipeline.run(m.mod, CUDA, m.params, Options(level="v3", reduction=request.param))


def test_fp16_partials_are_block_local_to_the_tensor_core_gemm(fp16_stitched):
    form, _, s = fp16_stitched
    (k,) = s.stitched
    assert k.safety.ok and k.grid_syncs >= 1
    if form == "deterministic":
        assert s.two_phase.split == {"T_add_sum": "sum", "T_add_var_sum": "sum-sq"}
        # the tile on chip | tensor-core GEMM | block barrier | both partials (one stage, the
        # lanes' sums meeting in shared memory) | grid sync | combine + normalise
        assert _barriers(s.mod[k.name]) == ["onchip", "stage", "block", "stage", "grid", "stage"]
    else:
        assert s.two_phase.split == {"T_add_sum": "sum (atomic)", "T_add_var_sum": "sum-sq (atomic)"}
        assert dependence.atomic_targets(s.mod[k.function].body)


def test_fp16_two_phase_kernel_emulated_matches_without_a_race(fp16_stitched):
    """Both forms through the race-checking emulator, blocks ascending, descending and shuffled, against
    onnxruntime (measured: rel. L2 1.74e-3 in both forms and orders; fp16 GEMM)."""
    from souffle_tvm.runtime import races

    _, m, s = fp16_stitched
    emu = races.Emulation(s.mod, CUDA)
    feeds = runner.random_inputs(m.inputs, 0)
    _, ref = runner.reference_outputs(m.onnx_model, feeds)
    for order in ("ascending", "descending", "shuffle:3"):
        outs, report = emu.run(runner.check_feeds(m.inputs, feeds), s.params, order)
        assert report.ok, str(report)
        for cmp in runner.compare(m.outputs, outs, ref):
            assert cmp.finite and cmp.rel_l2 < 4e-3, (order, cmp)


@needs_nvcc
def test_lane_partials_build_with_nvcc_without_spills():
    """The fp16 tensor-core GEMM's 32 x 64 tiles: 8 lanes a tile row (the partial stage's 256
    threads, their sums added in shared memory), ptxas-clean and co-resident."""
    c = compile_model(gemm_then("layernorm", dtype="float16"), "cuda", "souffle", level="v3", dtype="float16")
    (k,) = [k for k in c.report.kernels if k.cooperative]
    assert k.spill_bytes == 0 and k.grid[0] <= k.max_coresident
    partial = next(st for name, st in zip(k.stages, k.stage_plan) if name.endswith("_partial"))
    assert partial["threads"] == 32 * 8


# -- the latency model's verdict ------------------------------------------------------------------
def test_the_latency_model_keeps_a_split_it_predicts_slower():
    """Under the time-driven partitioner the judge decides, and says both figures. One thread per
    tile row in the GEMM's 128 blocks (16 x 16 tiles) reads the rows far slower than a row reduction per block."""
    m = frontend.import_onnx(gemm_then("layernorm"))
    s = pipeline.run(m.mod, CUDA, m.params, Options(level="v3", partitioner="time"))
    assert not s.two_phase.split and set(s.two_phase.kept) == {"T_add_sum", "T_add_var_sum"}
    for why in s.two_phase.kept.values():
        assert why.startswith("the latency model predicts the split slower") and "GEMM's 128 tiles" in why
        split_us, whole_us = (float(x) for x in re.findall(r"([0-9.]+) us", why))
        assert split_us > whole_us


def test_split_pays_when_the_partials_outnumber_the_rows():
    """The judge's figures on hand-sized cases: a few long rows (64 rows of 131072) split over
    2048 GEMM tiles gain the parallelism a row-per-block reduction lacks; BERT-base's attention
    rows (4608 of 384) do not."""
    from souffle_tvm.planning.partials import split_pays
    from souffle_tvm.transforms.two_phase import Candidate

    assert split_pays(Candidate("long", "sum", 64, 131072, (64, 64), 4, 4, 1)) is None
    why = split_pays(Candidate("short", "sum", 4608, 384, (64, 64), 2, 4, 1))
    assert why is not None and "predicts the split slower" in why


def test_the_report_carries_the_split_and_kept_reductions():
    compiled = compile_model(gemm_then("layernorm"), "llvm", "souffle", level="v3")
    assert compiled.report.fallback is None
    assert compiled.report.reductions == {"split": {"T_add_sum": "sum", "T_add_var_sum": "sum-sq"}, "kept": {}}
    assert "two-phase reductions: 2 split, 0 kept whole" in compiled.report.table()
