"""Repeated stages as loops inside the stitched kernel (``rolling``): the LSTM's time steps."""

import dataclasses
from types import SimpleNamespace

import pytest
import tvm
from tvm import tirx

from souffle_tvm.cost import hardware
from souffle_tvm.cost.estimate import Estimate
from souffle_tvm.partition import subprograms
from souffle_tvm.partition.subprograms import GroupFacts
from souffle_tvm.pipeline import results as pipeline
from souffle_tvm.pipeline.options import Options
from souffle_tvm.stitch import repeats, rolling
from souffle_tvm.stitch import check as stitch_check, kernel_ir
from souffle_tvm.stitch.module import stitch_module
from souffle_tvm.core.ir_names import STAGE_BLOCKS
from souffle_tvm.frontend import accumulation
from souffle_tvm.frontend.importer import import_onnx
from souffle_tvm.core.targets import make_target
from conftest import emulated_comparisons, needs_nvcc

CUDA = make_target("cuda")


@pytest.fixture(scope="module")
def lstm():
    m = import_onnx("lstm", small=True)          # 2 layers x 8 steps
    return m, pipeline.run(m.mod, CUDA, m.params, Options(level="v3"))


def _rolled(func) -> list:
    return [s for s in kernel_ir.stage_loops(func) if isinstance(s, tirx.For) and rolling.ROLLED in s.annotations]


def _emulated(m, souffle, mod):
    return emulated_comparisons(m, mod, souffle.params)


def test_lstm_time_steps_become_one_loop_per_layer(lstm):
    m, souffle = lstm
    [k] = souffle.stitched
    func = souffle.mod[k.function]
    loops = _rolled(func)
    assert len(loops) == 2 and all(int(lp.extent) >= rolling.MIN_TRIPS for lp in loops)
    # the loops hold the stages of most time steps: the kernel's code is a fraction of its stages
    stage_loops = lambda f: [s for s in kernel_ir.stage_loops(f) if STAGE_BLOCKS in getattr(s, "annotations", {})]  # noqa: E731
    assert len(stage_loops(func)) < len(k.stages) // 2
    # written out, the loops give back every stage, and the static check holds on that form
    assert len(stage_loops(rolling.unroll(func))) == len(k.stages)
    assert k.safety.ok and k.grid_syncs == stitch_check.check(func, k.grid, None).grid_syncs
    # the per-step tensors (gates, c, h) are slots of stacked buffers, a slot per step of the run
    stacks = [p for p in func.params if p.name.endswith("_stack")]
    assert stacks and all(min(int(lp.extent) for lp in loops) <= int(p.ty.shape[0]) <= 8 for p in stacks)


def test_a_rolled_loop_one_step_short_is_caught(lstm):
    """(test_emulate runs the rolled kernel itself against onnxruntime; a loop one step short
    must not pass for it.)"""
    m, souffle = lstm
    func = souffle.mod["souffle_stitched_0"]
    seq = kernel_ir.stage_loops(func)
    first = next(i for i, s in enumerate(seq) if isinstance(s, tirx.For) and rolling.ROLLED in s.annotations)
    loop = seq[first]
    short = tirx.For(loop.loop_var, loop.min, tirx.const(int(loop.extent) - 1, "int64"), loop.kind, loop.body,
                     annotations={rolling.ROLLED: tirx.const(int(loop.extent) - 1, "int64")})
    broken = kernel_ir.replace_stages(func, seq[:first] + [short] + seq[first + 1:])
    gv = souffle.mod.get_global_var("souffle_stitched_0")
    mod = tvm.IRModule({g: (broken if g.same_as(gv) else f) for g, f in souffle.mod.functions.items()},
                       attrs=souffle.mod.attrs)
    assert not all(c.ok(1e-5) for c in _emulated(m, souffle, mod))


def test_without_stackable_tensors_nothing_is_rolled(lstm, monkeypatch):
    """A tensor read after the kernel may not become a slot: with none stackable, no loop."""
    m, souffle = lstm
    calls = [b for blk in souffle.unstitched["main"].body.blocks for b in blk.bindings
             if isinstance(b.value, tvm.relax.Call) and b.value.op.name == "relax.call_tir"]
    mod, kernels = stitch_module(souffle.unstitched, CUDA, [list(range(len(calls)))], grid=132)
    assert _rolled(mod[kernels[0].function])       # stitch_module's own analysis allows it here

    seen = []
    real = rolling.roll

    def nothing_stackable(items, keys, writes, var_of, stackable, **kw):
        seen.append(True)
        return real(items, keys, writes, var_of, lambda k: False, **kw)

    monkeypatch.setattr(rolling, "roll", nothing_stackable)
    mod, kernels = stitch_module(souffle.unstitched, CUDA, [list(range(len(calls)))], grid=132)
    assert seen and not _rolled(mod[kernels[0].function])
    assert kernels[0].safety.ok and len(kernels[0].stages) == len(souffle.stitched[0].stages)


def test_repeats_are_whole_iterations_with_inputs_one_period_later():
    # g0 makes h0; g1..g4 each read the previous h and a shared weight: a run of 4 iterations
    sigs = ["init"] + ["step"] * 5
    reads = [[("ext", "x")]] + [[("group", i, 0), ("ext", "w")] for i in range(4)] + [[("group", 4, 0), ("ext", "w2")]]
    assert repeats.repeats(sigs, reads) == [None, None, 1, 2, 3, None]    # g5's weight differs
    # period 2 (a block with its own weight, then a weight-free stage): only the weight-free
    # stages repeat, no whole iteration does, so nothing counts as rolled
    sigs = ["conv", "act"] * 4
    reads = [[("group", i - 1, 0) if i else ("ext", "x"), ("ext", f"w{i}")] if i % 2 == 0 else [("group", i - 1, 0)]
             for i in range(8)]
    assert repeats.repeats(sigs, reads) == [None] * 8


def test_partitioner_counts_a_repeated_group_once():
    groups = [SimpleNamespace(name=f"g{i}", opaque=None) for i in range(40)]
    repeat_of = [None, None] + [i - 1 for i in range(2, 40)]
    small = [[Estimate(registers=32, shared_bytes=0, spills=False)]] * 40
    facts = GroupFacts([None] * 40, statements=[100] * 40, stages=small)
    gpu = hardware.for_arch("sm_90")
    assert len(subprograms.by_budget(groups, lambda i, j, k: 0, facts, gpu, max_statements=512)) > 1
    facts = dataclasses.replace(facts, repeat_of=repeat_of)
    [(idx, why)] = subprograms.by_budget(groups, lambda i, j, k: 0, facts, gpu, max_statements=512)
    assert idx == list(range(40)) and why == "end of model"


def _cut_inside_the_first_layer(souffle):
    calls = [b for blk in souffle.unstitched["main"].body.blocks for b in blk.bindings
             if isinstance(b.value, tvm.relax.Call) and b.value.op.name == "relax.call_tir"]
    cut = len(calls) // 4
    return stitch_module(souffle.unstitched, CUDA, [list(range(cut)), list(range(cut, len(calls)))], grid=132)


def test_tensors_read_after_the_kernel_are_not_stacked(lstm):
    """Cut inside the first layer's time steps: the next layer's projection (in the second
    kernel) reads every h of the first, so they cannot become slots."""
    _, souffle = lstm
    mod, kernels = _cut_inside_the_first_layer(souffle)
    first, second = (mod[k.function] for k in kernels)
    assert not [p for p in first.params if p.name.startswith("T_multiply") and p.name.endswith("_stack")]
    assert _rolled(second)


@pytest.mark.slow     # ~20 s; the rolled kernel's own numerics are in test_emulate by default
def test_a_cut_rolled_lstm_matches_the_reference(lstm):
    m, souffle = lstm
    mod, _ = _cut_inside_the_first_layer(souffle)
    for cmp in _emulated(m, souffle, mod):
        assert cmp.finite and cmp.rel_l2 < 1e-5, cmp


def _shared_allocs(func) -> list:
    return [s.buffer for s in kernel_ir.stage_loops(func)
            if isinstance(s, tirx.AllocBuffer) and str(s.buffer.ty.storage_scope) == "shared"]


def test_a_channel_of_every_step_rolls_into_a_stack_in_shared_memory(lstm):
    """The batch-2 LSTM's cell state c is made and read on block 0 only, step after step: each
    step's c is a channel (``dependence.covering_box``, written under ``if tid < 32`` in one
    statement), and the time steps still roll: the channels become the slots of one shared
    stack per layer, which no parameter holds. Race-checked against onnxruntime here in one
    block order (test_emulate runs three in ``make test-all``)."""
    m, souffle = lstm
    [k] = souffle.stitched
    func = souffle.mod[k.function]
    assert len(_rolled(func)) == 2
    stacks = [b for b in _shared_allocs(func) if b.name.endswith("_onchip_stack")]
    assert len(stacks) >= 2 and all(int(b.ty.shape[0]) <= 8 for b in stacks)
    assert not [p for p in func.params if p.name.startswith("T_add")]      # every c stays on chip
    assert k.onchip_bytes >= sum(4 * int(b.ty.shape[0]) * int(b.ty.shape[1]) * int(b.ty.shape[2]) for b in stacks)
    from conftest import race_checked_in_orders
    for order, report, comparisons in race_checked_in_orders(m, souffle, ("shuffle:3",)):
        assert report.ok, str(report)
        for cmp in comparisons:
            assert cmp.finite and cmp.rel_l2 < 1e-5, (order, cmp)


@needs_nvcc
def test_a_shared_stack_builds_with_nvcc_without_spills():
    """The small LSTM's kernel with its shared stacks of c, built by nvcc (sm_90): no spills,
    its grid co-resident, and no c among its parameters. (TVM's StorageRewrite gives the stacks
    the space of GEMM tiles not live while they are: the source names no stack of its own.)"""
    import re
    from souffle_tvm.pipeline.driver import compile as compile_model
    c = compile_model("lstm", "cuda", "souffle", small=True, level="v3")
    [k] = [k for k in c.report.kernels if k.cooperative]
    assert k.spill_bytes == 0 and k.grid[0] <= k.max_coresident
    [signature] = set(re.findall(r"void __launch_bounds__\(\d+\) souffle_stitched_0_kernel\(([^)]*)\)", c.cuda_source))
    params = [p.split()[-1] for p in signature.split(",")]
    assert any(p.startswith("T_multiply") for p in params) and not any(p.startswith("T_add") for p in params)


@pytest.fixture(scope="module")
def lstm_b1(tmp_path_factory):
    """The small LSTM at batch 1 (the full model's form): its recurrent product runs on every
    block, and the next step's h is written behind a block barrier only, into another slot."""
    import onnx
    from souffle_tvm.zoo import lstm as lstm_zoo
    path = tmp_path_factory.mktemp("lstm") / "lstm_b1.onnx"
    onnx.save(lstm_zoo.build(lstm_zoo.LSTMConfig(layers=2, steps=8, hidden=16, features=16, batch=1)), str(path))
    m = import_onnx(str(path))
    return m, pipeline.run(m.mod, CUDA, m.params, Options(level="v3"))


def _h_store_one_slot_back(func):
    """The rolled loop's store of h into slot ``step + 1`` moved to slot ``step``: the slot the
    other blocks' recurrent product of the step before may still be reading."""
    import tvm_ffi
    seq = kernel_ir.stage_loops(func)
    i = next(i for i, s in enumerate(seq) if isinstance(s, tirx.For) and rolling.ROLLED in s.annotations)
    step = seq[i].loop_var
    moved = []

    def store(s):
        first = s.indices[0]
        if s.buffer.name == "T_multiply_stack" and isinstance(first, tirx.Add) and first.a.same_as(step) and not moved:
            moved.append(s)
            return tirx.BufferStore(s.buffer, s.value, [step] + list(s.indices)[1:])
        return s

    loop = tvm_ffi.structural_map(seq[i], (tirx.BufferStore, store))
    assert moved
    return kernel_ir.replace_stages(func, seq[:i] + [loop] + seq[i + 1:])


def test_a_stack_is_checked_slot_by_slot(lstm_b1):
    """The static check tells a stack's slots apart (``rolling.unstack``): the rolled batch-1
    LSTM, where step t+1's h goes into its own slot behind a block barrier while other blocks
    may still read step t's, passes; the same store moved into step t's slot is a write after
    read with no grid sync, and is caught."""
    _, souffle = lstm_b1
    [k] = [k for k in souffle.stitched if _rolled(souffle.mod[k.function])]
    func = souffle.mod[k.function]
    assert stitch_check.check(func, k.grid, None).ok
    problems = stitch_check.check(_h_store_one_slot_back(func), k.grid, None).problems
    assert any("writes T_multiply_stack" in p and "no grid sync" in p for p in problems), problems


@pytest.fixture(scope="module")
def lstm_lm_fp16():
    import hf_models as hf

    m = import_onnx(hf.export("lstm_lm"), dtype="float16")
    return dataclasses.replace(m, mod=accumulation.accumulate_in_float32(m.mod))


def test_a_stacked_channel_read_after_a_grid_sync_stays_on_chip(lstm_lm_fp16):
    """Issue 58, item 2, reproduced: the LSTM language model of the architecture net under
    ``--dtype float16``, its GEMMs accumulating in float32 (``frontend.accumulation``, which the
    importer applies to bf16 alone; their casts back kept as epilogues),
    stitches at v3 a rolled kernel with a stacked on-chip channel (the gates' sum, one slot per
    step) read after a grid sync, so its reader begins with a block barrier. The static check
    read that reader with its thread guard still on, proved nothing, and the user got "stage 8
    reads T_add_onchip_stack_0, written by an earlier stage with no grid sync between". The
    check now proves what the plan proved: the channels stay on chip."""
    m = lstm_lm_fp16
    souffle = pipeline.run(m.mod, CUDA, m.params, Options(level="v3"))
    assert souffle.stitched and all(k.safety.ok for k in souffle.stitched)
    assert any(k.onchip_bytes for k in souffle.stitched)
    for c in emulated_comparisons(m, souffle.mod, souffle.params):
        assert c.finite and c.rel_l2 < 1e-2, c


@pytest.mark.slow      # ~15 s (the default suite's time)
def test_a_channel_the_check_refuses_falls_back_to_global_memory(lstm_lm_fp16, monkeypatch):
    """The safety net behind the proof: a kernel the static check refuses over a channel (planted:
    every kernel with a channel refused, as the check's guard reading used to refuse this one) is
    stitched again with its tensors in global memory, safe, instead of failing the compile."""
    from souffle_tvm.stitch import module

    real = module.check

    def refusing(func, grid, coresident):
        report = real(func, grid, coresident)
        if "_onchip" in func.script():
            report.problems.append("stage 2 reads T_add_onchip_0, written by an earlier stage with no grid sync between")
        return report

    monkeypatch.setattr(module, "check", refusing)
    m = lstm_lm_fp16
    souffle = pipeline.run(m.mod, CUDA, m.params, Options(level="v3"))
    assert souffle.stitched and all(k.safety.ok for k in souffle.stitched)
    assert not any(k.onchip_bytes for k in souffle.stitched)
