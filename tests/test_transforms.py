"""Each transform alone, and all of them, preserve what the model computes."""

import pytest

from conftest import ZOO
from souffle_tvm.te import analysis
from souffle_tvm.runtime import runner
from souffle_tvm.te import program as te_program
from souffle_tvm.frontend.importer import import_onnx
from souffle_tvm.transforms import fold_weights, horizontal, vertical
from test_te_program import run_program

TRANSFORMS = {
    "fold_weights": lambda p: fold_weights(p).program,
    "horizontal": lambda p: horizontal(p).program,
    "vertical": lambda p: vertical(p).program,
    "all": lambda p: vertical(horizontal(fold_weights(p).program).program).program,
}


@pytest.fixture(scope="module")
def imported():
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = import_onnx(name, small=True)
        return cache[name]

    return get


# Swin has nothing for horizontal fusion to merge (V1 = V0): that case is `slow` (~18 s); so are
# fold_weights alone (~24 s: the unfused program), vertical (~12 s) and all of them (~24 s): the
# other five models cover the transforms in `make test`.
@pytest.mark.parametrize("name,transform", [
    pytest.param(n, t, marks=pytest.mark.slow) if (n, t) in (("swin", "horizontal"), ("swin", "fold_weights"),
                                                             ("swin", "vertical"), ("swin", "all"))
    else (n, t) for n in ZOO for t in TRANSFORMS])
def test_transform_preserves_numerics(imported, name, transform):
    m = imported(name)
    prog = TRANSFORMS[transform](te_program.lower(m.mod, weight_values=m.params))
    feeds = runner.random_inputs(m.inputs, 1)
    got = run_program(prog, m, feeds)
    _, ref = runner.reference_outputs(m.onnx_model, feeds)
    for c in runner.compare(m.outputs, got, ref):
        assert c.finite and c.rel_l2 < 1e-5, (name, transform, c)


@pytest.mark.parametrize("name", ZOO)
def test_vertical_leaves_no_unexplained_one_to_one_stage(imported, name):
    m = imported(name)
    v = vertical(te_program.lower(m.mod, weight_values=m.params))
    after = analysis.analyze(v.program)
    survivors = [s for s in after.stages if s.kind in (analysis.ONE_TO_ONE, analysis.GATHER)]
    assert len(v.inlined) > 0
    # Every survivor was kept for a recorded reason (its name in ``kept``), never silently.
    kept_names = {k.split("#")[0] for k in v.kept}
    for s in survivors:
        assert s.name.split("#")[0] in kept_names, s.name
    # Pure index maps (reshape/transpose/slice/broadcast) never survive unless pinned.
    pinned = {k for k, r in v.kept.items() if r in ("model output",) or r.startswith("feeds opaque")}
    for s in survivors:
        if s.detail in ("reshape", "transpose", "slice", "broadcast"):
            assert s.name in pinned, (s.name, s.detail)


def test_horizontal_merges_qkv_and_experts(imported):
    h = horizontal(fold_weights(te_program.lower(imported("bert").mod, weight_values=imported("bert").params)).program)
    assert sum(1 for s in h.merged if len(s) == 3 and s[0] == "matmul") == 2   # Q, K, V in both layers
    m = imported("mmoe")
    h = horizontal(fold_weights(te_program.lower(m.mod, weight_values=m.params)).program)
    assert any(len(s) == 4 and s[0] == "matmul" for s in h.merged)             # the four experts
    merged_weights = [w for w in h.program.weights if "_h4" in w.op.name]
    assert merged_weights and int(merged_weights[0].shape[-1]) == 4 * 8            # [K, 4N]


def test_fold_weights_removes_weight_layout_stages(imported):
    m = imported("mmoe")   # Gemm(transB=1): the weight transposes are weight-only stages
    prog = te_program.lower(m.mod, weight_values=m.params)
    folded = fold_weights(prog)
    assert len(folded.folded) >= 8
    before = sum(1 for t in prog.stages() if all(x.op in {w.op for w in prog.weights} for x in t.op.input_tensors))
    after_prog = folded.program
    after = sum(1 for t in after_prog.stages()
                if all(x.op in {w.op for w in after_prog.weights} for x in t.op.input_tensors))
    assert before >= 8 and after == 0
