"""The ONNX GRU converter against onnxruntime: directions, linear_before_reset, states, clip."""

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from souffle_tvm.runtime import runner
from souffle_tvm.pipeline.driver import compile as compile_model


def gru_model(seq=5, batch=3, d_in=4, hidden=6, direction="forward", lbr=0, states=True, bias=True,
              outputs=2, seed=0, layout=0, **attrs):
    rng = np.random.default_rng(seed)
    dirs = 2 if direction == "bidirectional" else 1
    inits = [numpy_helper.from_array(rng.standard_normal((dirs, 3 * hidden, d_in)).astype(np.float32) * 0.5, "W"),
             numpy_helper.from_array(rng.standard_normal((dirs, 3 * hidden, hidden)).astype(np.float32) * 0.5, "R")]
    names = ["X", "W", "R", "", "", ""]
    if bias:
        inits.append(numpy_helper.from_array(rng.standard_normal((dirs, 6 * hidden)).astype(np.float32) * 0.5, "B"))
        names[3] = "B"
    if states:
        state = (batch, dirs, hidden) if layout else (dirs, batch, hidden)
        inits.append(numpy_helper.from_array(rng.standard_normal(state).astype(np.float32), "H0"))
        names[5] = "H0"
    while names[-1] == "":
        names.pop()
    outs = ["Y", "Y_h"][:outputs]
    node = helper.make_node("GRU", names, outs, hidden_size=hidden, direction=direction,
                            linear_before_reset=lbr, layout=layout, **attrs)
    shapes = ({"Y": [batch, seq, dirs, hidden], "Y_h": [batch, dirs, hidden]} if layout else
              {"Y": [seq, dirs, batch, hidden], "Y_h": [dirs, batch, hidden]})
    x_shape = [batch, seq, d_in] if layout else [seq, batch, d_in]
    graph = helper.make_graph(
        [node], "gru", [helper.make_tensor_value_info("X", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, shapes[o]) for o in outs], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])


def check(model, tol=1e-5, reference=runner.reference_outputs):
    compiled = compile_model(model, "llvm")
    feeds = runner.random_inputs(compiled.model.inputs, 7)
    outs = runner.run_vm(compiled.executable, compiled.model.params, runner.check_feeds(compiled.model.inputs, feeds))
    _, ref = reference(model, feeds)
    assert len(outs) == len(ref) == len(model.graph.output)
    for c in runner.compare(compiled.model.outputs, outs, ref):
        assert c.finite and c.rel_l2 < tol, f"{c.name}: rel L2 {c.rel_l2:.2e}"


@pytest.mark.parametrize("lbr", [0, 1])
@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
def test_directions_and_linear_before_reset(direction, lbr):
    check(gru_model(direction=direction, lbr=lbr, seed=lbr))


@pytest.mark.parametrize("lbr", [0, 1])
def test_no_bias_no_state_clip_and_y_only(lbr):
    check(gru_model(lbr=lbr, bias=False, states=False, batch=1, seed=3))
    check(gru_model(lbr=lbr, clip=0.6, seed=4))
    check(gru_model(lbr=lbr, outputs=1, direction="bidirectional", seed=5))


def test_differs_between_linear_before_reset_modes():
    # The two formulas must give different answers on the same weights; a converter that
    # ignored the attribute would pass both parametrised tests above only by accident.
    m0, m1 = gru_model(lbr=0), gru_model(lbr=1)
    feeds = {"X": np.random.default_rng(1).standard_normal((5, 3, 4)).astype(np.float32)}
    (y0, _), (y1, _) = runner.reference_outputs(m0, feeds)[1], runner.reference_outputs(m1, feeds)[1]
    assert np.linalg.norm(y0 - y1) / np.linalg.norm(y0) > 1e-2


def test_batch_first_layout():
    # onnxruntime refuses layout=1 (as for LSTM): ONNX's reference evaluator checks this one.
    from onnx.reference import ReferenceEvaluator

    check(gru_model(layout=1, lbr=1, direction="bidirectional"),
          reference=lambda m, f: ("onnx.reference", ReferenceEvaluator(m).run(None, f)))
