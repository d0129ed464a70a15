"""An op with several outputs (ArgMin/ArgMax: a tuple reduction of index and value) is one stage:
both outputs in one group, at every level. Before 2026-12-05 the partition put each output in a
group of its own: the reduction ran twice, and at v3 and the default level on CUDA the first
group's value accumulator was left in an allocated global buffer that CUDA codegen refuses
("Cannot allocate global memory"), so every ArgMin/ArgMax model failed to compile there."""

from __future__ import annotations

import pytest
from onnx.backend.test.loader import load_model_tests

from souffle_tvm.core.targets import make_target
from souffle_tvm.frontend.importer import import_onnx
from souffle_tvm.pipeline import results
from souffle_tvm.pipeline.driver import compile as compile_model
from souffle_tvm.pipeline.options import Options
from souffle_tvm.runtime import runner

CASES = ["test_argmin_no_keepdims_random", "test_argmax_keepdims_random_select_last_index"]


@pytest.fixture(scope="module")
def models():
    want = set(CASES)
    return {c.name: c.model for c in load_model_tests(kind="node") if c.name in want}


@pytest.mark.parametrize("level", ["v2", "v3"])
@pytest.mark.parametrize("name", CASES)
def test_both_outputs_of_the_reduction_share_a_group(models, name, level):
    m = import_onnx(models[name])
    s = results.run(m.mod, make_target("cuda"), m.params, Options(level=level).resolved())
    (temp,) = {t.op for t in s.program.stages() if t.op.num_outputs == 2}
    holding = [g for g in s.partition.groups if any(t.op.same_as(temp) for t in g.members)]
    assert len(holding) == 1 and sum(t.op.same_as(temp) for t in holding[0].members) == 2


@pytest.mark.parametrize("level", ["v3", "auto"])
@pytest.mark.parametrize("name", CASES)
def test_compiles_for_cuda_and_matches_onnxruntime_on_llvm(models, name, level):
    r = compile_model(models[name], "cuda", "souffle", level=level, nvcc=False).report
    assert r.fusion == "souffle" and not r.fallback and r.launches == 1
    compiled = compile_model(models[name], "llvm", "souffle", level=level)
    feeds = runner.random_inputs(compiled.model.inputs, 3)
    outs = runner.run_vm(compiled.executable, compiled.model.params, runner.check_feeds(compiled.model.inputs, feeds))
    _, ref = runner.reference_outputs(compiled.model.onnx_model, feeds)
    (c,) = runner.compare(compiled.model.outputs, outs, ref)
    assert c.finite and c.rel_l2 == 0, c


@pytest.mark.parametrize("name", CASES)
def test_cuda_kernels_emulated_match_onnxruntime(models, name):
    """The CUDA module's kernels in the GPU emulator: the tuple reduction's index and value are
    combined across the threads of a row together (a two-value ``tvm_thread_allreduce``, which
    the emulator refused before 2026-12-05)."""
    import tvm

    from souffle_tvm.runtime import emulate
    from souffle_tvm.stitch import kernel_ir, lower

    m = import_onnx(models[name])
    souffle = results.run(m.mod, make_target("cuda"), m.params, Options(level="auto").resolved())
    sizes = [int(c.args[0].value) for gv, f in souffle.mod.functions.items() if isinstance(f, tvm.tirx.PrimFunc)
             for c in kernel_ir.calls_to(lower.launch_form(f, make_target("cuda"), gv.name_hint).body,
                                         ("tirx.tvm_thread_allreduce",))]
    assert 2 in sizes
    ex = tvm.compile(emulate.emulate_module(souffle.mod, make_target("cuda")), target=make_target("llvm"))
    feeds = runner.random_inputs(m.inputs, 3)
    outs = runner.run_vm(ex, souffle.params, runner.check_feeds(m.inputs, feeds))
    _, ref = runner.reference_outputs(m.onnx_model, feeds)
    (c,) = runner.compare(m.outputs, outs, ref)
    assert c.finite and c.rel_l2 == 0, c
