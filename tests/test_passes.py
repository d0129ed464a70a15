"""The Souffle passes inside tvm.transform.Sequential, next to TVM's own Relax passes."""

import tvm
from tvm import relax


from souffle_tvm.pipeline import passes
from souffle_tvm.runtime import runner
from souffle_tvm.frontend.importer import import_onnx
from souffle_tvm.core.targets import make_target


def _build_and_check(mod, m):
    ex = tvm.compile(mod, make_target("llvm"))
    feeds = runner.random_inputs(m.inputs, 4)
    outs = runner.run_vm(ex, [p.numpy() for p in passes.params_of(mod)], runner.check_feeds(m.inputs, feeds))
    _, ref = runner.reference_outputs(m.onnx_model, feeds)
    return runner.compare(m.outputs, outs, ref)


def test_pipeline_composes_with_tvm_passes_and_builds():
    m = import_onnx("bert", small=True)
    seq = tvm.transform.Sequential([
        relax.transform.FoldConstant(),
        relax.transform.CanonicalizeBindings(),
        passes.SoufflePipeline(make_target("llvm"), m.params),
        relax.transform.DeadCodeElimination(),
    ])
    mod = seq(m.mod)
    assert any(gv.name_hint.startswith("souffle_") for gv in mod.get_global_vars())
    for c in _build_and_check(mod, m):
        assert c.rel_l2 < 1e-5


def test_each_pass_alone_and_disabled_by_name():
    m = import_onnx("mmoe", small=True)
    lowered = passes.LowerToTE(m.params)(m.mod)
    assert "souffle.te_program" in lowered.attrs
    after_h = passes.HorizontalFusion()(passes.FoldWeights()(lowered))
    assert passes.info_of(after_h)["horizontal"].merged
    with tvm.transform.PassContext(disabled_pass=["souffle.HorizontalFusion"]):
        mod = passes.SoufflePipeline(make_target("llvm"), m.params)(m.mod)
    assert "horizontal" not in passes.info_of(mod)
    assert "vertical" in passes.info_of(mod)
    for c in _build_and_check(mod, m):
        assert c.rel_l2 < 1e-5


def test_instruments_see_every_souffle_pass():
    seen = []

    @tvm.instrument.pass_instrument
    class Record:
        def run_before_pass(self, _mod, info):
            seen.append(info.name)

    m = import_onnx("mmoe", small=True)
    with tvm.transform.PassContext(instruments=[Record()]):
        passes.SoufflePipeline(make_target("llvm"), m.params)(m.mod)
    for name in ("souffle.LowerToTE", "souffle.FoldWeights", "souffle.HorizontalFusion", "souffle.VerticalFusion",
                 "souffle.PartitionAndEmit"):
        assert name in seen


def test_transform_without_lowering_is_a_clear_error():
    import pytest



    m = import_onnx("mmoe", small=True)
    with pytest.raises(Exception, match="LowerToTE"):
        passes.VerticalFusion()(m.mod)



def test_user_sequential_with_timing_instrument_opt_level_and_tvm_compile():
    """What a user writes: TVM's Relax passes around the Souffle pipeline in one Sequential,
    under a PassContext with an opt_level, a disabled pass and TVM's PassTimingInstrument; then
    ``tvm.compile`` in the same context, and the numbers match onnxruntime."""
    m = import_onnx("mmoe", small=True)
    target = make_target("llvm")
    seq = tvm.transform.Sequential([
        relax.transform.FoldConstant(),
        relax.transform.CanonicalizeBindings(),
        passes.SoufflePipeline(target, m.params),
        relax.transform.DeadCodeElimination(),
    ])
    for opt_level in (0, 3):    # Souffle's passes are opt_level 0: they run at every level, -O0 included
        timing = tvm.ir.instrument.PassTimingInstrument()
        with tvm.transform.PassContext(opt_level=opt_level, instruments=[timing],
                                       disabled_pass=["souffle.VerticalFusion"]):
            mod = seq(m.mod)
            profile = timing.render()
            ex = tvm.compile(mod, target)
        for name in ("souffle.LowerToTE", "souffle.FoldWeights", "souffle.HorizontalFusion",
                     "souffle.PartitionAndEmit", "FoldConstant"):
            assert f"{name}:" in profile, (opt_level, name)
        # the context's opt_level is honoured: TVM's DeadCodeElimination (opt_level 1) is skipped at -O0
        assert ("DeadCodeElimination:" in profile) == (opt_level >= 1)
        assert "souffle.VerticalFusion:" not in profile and "vertical" not in passes.info_of(mod)
        assert passes.info_of(mod)["horizontal"].merged
        feeds = runner.random_inputs(m.inputs, 2)
        outs = runner.run_vm(ex, [p.numpy() for p in passes.params_of(mod)], runner.check_feeds(m.inputs, feeds))
        _, ref = runner.reference_outputs(m.onnx_model, feeds)
        assert all(c.rel_l2 < 1e-5 for c in runner.compare(m.outputs, outs, ref))
