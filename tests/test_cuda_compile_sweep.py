"""Models of ONNX's conformance suite that ran on llvm but failed to compile for CUDA at the
default level (``python -m souffle_experiments sweep``, results/cuda-compile-sweep-2026-12-05): each now
compiles for CUDA with either fusion and still matches onnxruntime on llvm."""

from __future__ import annotations

import pytest
from onnx.backend.test.loader import load_model_tests

from souffle_tvm.pipeline.driver import compile as compile_model
from souffle_tvm.runtime import runner

# test name -> what failed before
CASES = {
    "test_causal_conv_with_state_kernel_size_one_expanded": "dlight divides by the empty state's zero extent",
    "test_eyelike_without_dtype": "TVM's build folds the model whole: no latency to compare with",
    "test_mod_mixed_sign_float16": "no float16 fmod in TVM's CUDA codegen",
}


@pytest.fixture(scope="module")
def models():
    return {c.name: c.model for c in load_model_tests(kind="node") if c.name in CASES}


@pytest.mark.parametrize("fusion", ["tvm", "souffle"])
@pytest.mark.parametrize("name", list(CASES))
def test_compiles_for_cuda_at_the_default_level(models, name, fusion):
    r = compile_model(models[name], "cuda", fusion, nvcc=False).report
    assert r.fusion == fusion


@pytest.mark.parametrize("name", list(CASES))
def test_still_matches_onnxruntime_on_llvm(models, name):
    compiled = compile_model(models[name], "llvm", "souffle")
    feeds = runner.random_inputs(compiled.model.inputs, 5)
    outs = runner.run_vm(compiled.executable, compiled.model.params, runner.check_feeds(compiled.model.inputs, feeds))
    _, ref = runner.reference_outputs(compiled.model.onnx_model, feeds)
    for c in runner.compare(compiled.model.outputs, outs, ref):
        assert c.finite and c.rel_l2 < 1e-6, c


def test_a_function_writing_only_empty_tensors_emulates_as_nothing(models):
    import tvm

    from souffle_tvm.core.targets import make_target
    from souffle_tvm.frontend.importer import import_onnx
    from souffle_tvm.pipeline import results
    from souffle_tvm.pipeline.options import Options
    from souffle_tvm.runtime import emulate

    m = import_onnx(models["test_causal_conv_with_state_kernel_size_one_expanded"])
    souffle = results.run(m.mod, make_target("cuda"), m.params, Options(level="auto").resolved())
    ex = tvm.compile(emulate.emulate_module(souffle.mod, make_target("cuda")), target=make_target("llvm"))
    feeds = runner.random_inputs(m.inputs, 2)
    outs = runner.run_vm(ex, souffle.params, runner.check_feeds(m.inputs, feeds))
    _, ref = runner.reference_outputs(m.onnx_model, feeds)
    out, state = runner.compare(m.outputs, outs, ref)
    assert out.finite and out.rel_l2 < 1e-6 and state.rel_l2 == 0


def _mean_of_all():
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("ReduceMean", ["x"], ["y"], axes=[0, 1], keepdims=0)], "mean",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, 1024])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def test_a_reduction_to_a_scalar_is_not_launched_once_per_term():
    """dlight's GeneralReduction schedules a mean over every axis (a 0-d result) as a host loop
    that launches a one-thread kernel per term: 65,536 launches for 64 x 1024, each counted as
    one call. Such a schedule is passed over (``schedule.host_loops``), in our rules and in TVM's
    own list: no loop of either module runs around a launch, and the CUDA kernels, emulated,
    match onnxruntime."""
    import tvm

    from souffle_tvm.build.executable import fuse
    from souffle_tvm.codegen.schedule import host_loops
    from souffle_tvm.core.targets import make_target
    from souffle_tvm.frontend.importer import import_onnx
    from souffle_tvm.pipeline import results
    from souffle_tvm.pipeline.options import Options
    from souffle_tvm.runtime import emulate

    m = import_onnx(_mean_of_all())
    cuda = make_target("cuda")
    souffle = results.run(m.mod, cuda, m.params, Options(level="auto").resolved())
    for mod in (souffle.mod, fuse(m.mod, cuda)):               # ours, TVM's
        funcs = [f for f in mod.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
        assert funcs and not any(host_loops(f) for f in funcs)
    ex = tvm.compile(emulate.emulate_module(souffle.mod, cuda), target=make_target("llvm"))
    feeds = runner.random_inputs(m.inputs, 4)
    outs = runner.run_vm(ex, souffle.params, runner.check_feeds(m.inputs, feeds))
    _, ref = runner.reference_outputs(m.onnx_model, feeds)
    (c,) = runner.compare(m.outputs, outs, ref)
    assert c.finite and c.rel_l2 < 1e-5, c


def test_a_k_loop_that_rebinds_threads_to_copy_tiles_is_no_host_loop():
    """dlight's GEMM runs its K loop inside the launch, re-binding threadIdx to copy each tile:
    device code, not a loop of launches (a first version of ``host_loops`` refused it, and BERT
    fell to Fallback GEMMs)."""
    from tvm.s_tir import dlight as dl
    from tvm.script import tirx as T

    from souffle_tvm.codegen.schedule import host_loops
    from souffle_tvm.core.targets import make_target

    @T.prim_func(s_tir=True)
    def matmul(a: T.Buffer((256, 256), "float32"), b: T.Buffer((256, 256), "float32"),
               c: T.Buffer((256, 256), "float32")):
        T.func_attr({"tirx.noalias": True})
        for i, j, k in T.grid(256, 256, 256):
            with T.sblock("c"):
                vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                with T.init():
                    c[vi, vj] = T.float32(0)
                c[vi, vj] = c[vi, vj] + a[vi, vk] * b[vk, vj]

    cuda = make_target("cuda")
    with cuda:
        sch = dl.gpu.Matmul().apply(matmul, cuda, False)
    assert sch is not None and not host_loops(sch.mod["main"])
