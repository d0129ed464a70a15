"""``souffle_tvm.transform``: the passes where a TVM user looks, on modules with bound weights
(``relax.transform.BindParams``) and with weights passed separately, inside ``tvm.compile``."""

import warnings

import pytest
import tvm
from tvm import relax

from souffle_tvm import transform
from souffle_tvm.core.targets import make_target
from souffle_tvm.frontend.importer import import_onnx
from souffle_tvm.pipeline import passes
from souffle_tvm.pipeline.building import cuda_source
from souffle_tvm.pipeline.driver import compile as compile_model
from souffle_tvm.runtime import runner


def _bound(m) -> tvm.IRModule:
    """``m.mod`` with its weights bound into ``main`` as constants (main takes its inputs only)."""
    main = m.mod["main"]
    n = int(main.attrs["num_input"])
    return relax.transform.BindParams("main", {p: tvm.runtime.tensor(v) for p, v in zip(main.params[n:], m.params)})(m.mod)


def _check(m, outs, seed: int) -> None:
    _, ref = runner.reference_outputs(m.onnx_model, runner.random_inputs(m.inputs, seed))
    for c in runner.compare(m.outputs, outs, ref):
        assert c.rel_l2 < 1e-5, c


@pytest.fixture(scope="module")
def mmoe():
    return import_onnx("mmoe", small=True)


def test_the_passes_are_reexported_where_tvm_users_look():
    assert transform.SoufflePipeline is passes.SoufflePipeline and transform.LowerToTE is passes.LowerToTE
    assert transform.COOPERATIVE_TIR_PIPELINE == "souffle_tvm.cooperative"
    for name in transform.__all__:
        assert getattr(transform, name) is not None


def test_bound_weights_are_found_in_the_module_and_stay_bound(mmoe):
    llvm = make_target("llvm")
    bound = _bound(mmoe)
    assert len(bound["main"].params) == len(mmoe.inputs)
    # the old path too: souffle_tvm.pipeline.passes
    out = passes.SoufflePipeline(llvm)(bound)
    separate = passes.SoufflePipeline(llvm, mmoe.params)(mmoe.mod)
    # the bound constants are the weights: the experts' GEMMs are stacked as with separate weights
    merged = passes.info_of(out)["horizontal"].merged
    assert merged and merged == passes.info_of(separate)["horizontal"].merged
    assert len(passes.info_of(out)["partition"].groups) == len(passes.info_of(separate)["partition"].groups)
    # ... and bound again: main takes only its inputs, nothing is left to pass
    assert len(out["main"].params) == len(mmoe.inputs) and passes.params_of(out) == []
    feeds = runner.random_inputs(mmoe.inputs, 1)
    _check(mmoe, runner.run_vm(tvm.compile(out, llvm), [], runner.check_feeds(mmoe.inputs, feeds)), 1)


def test_inside_tvm_compile_with_bound_and_with_separate_weights():
    llvm = make_target("llvm")
    m = import_onnx("bert", small=True)
    feeds = runner.check_feeds(m.inputs, runner.random_inputs(m.inputs, 2))
    # bound: the whole Souffle pipeline as the head of tvm.compile's relax_pipeline
    ex = tvm.compile(_bound(m), llvm, relax_pipeline=tvm.transform.Sequential(
        [transform.SoufflePipeline(level="v2"), relax.get_pipeline("default")]))
    _check(m, runner.run_vm(ex, [], feeds), 2)
    # separate: main takes the weights the pipeline made after its inputs
    mod = transform.SoufflePipeline(llvm, m.params, level="v2")(m.mod)
    weights = [p.numpy() for p in transform.params_of(mod)]
    assert len(mod["main"].params) == len(m.inputs) + len(weights)
    _check(m, runner.run_vm(tvm.compile(mod, llvm), weights, feeds), 2)


def test_v3_inside_tvm_compile_stitches_for_the_target_tvm_compile_builds(mmoe):
    # made before any target is current: the passes are chosen when tvm.compile runs them
    cuda = make_target("cuda")
    seq = tvm.transform.Sequential([transform.SoufflePipeline(level="v3"), relax.get_default_pipeline(cuda)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", transform.CooperativeBuildWarning)
        ex = tvm.compile(_bound(mmoe), cuda, relax_pipeline=seq, tir_pipeline=transform.COOPERATIVE_TIR_PIPELINE)
    src = cuda_source(ex)
    assert "souffle_stitched_0_kernel" in src
    # the same kernels as the driver's (weights separate, no ptxas feedback)
    assert src == compile_model("mmoe", "cuda", "souffle", small=True, level="v3", nvcc=False).cuda_source
