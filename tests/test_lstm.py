"""The ONNX LSTM converter against onnxruntime: directions, batch, states, peepholes, layouts."""

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from souffle_tvm.runtime import runner
from souffle_tvm.pipeline.driver import compile as compile_model
from souffle_tvm.errors import UnsupportedOperatorError


def lstm_model(seq=5, batch=3, d_in=4, hidden=6, direction="forward", states=True, peephole=False,
               layout=0, seq_lens=None, outputs=3, seed=0, **attrs):
    rng = np.random.default_rng(seed)
    dirs = 2 if direction == "bidirectional" else 1
    inits = [
        numpy_helper.from_array(rng.standard_normal((dirs, 4 * hidden, d_in)).astype(np.float32) * 0.5, "W"),
        numpy_helper.from_array(rng.standard_normal((dirs, 4 * hidden, hidden)).astype(np.float32) * 0.5, "R"),
        numpy_helper.from_array(rng.standard_normal((dirs, 8 * hidden)).astype(np.float32) * 0.5, "B"),
    ]
    names = ["X", "W", "R", "B", "", "", "", ""]
    if seq_lens is not None:
        inits.append(numpy_helper.from_array(np.asarray(seq_lens, np.int32), "L"))
        names[4] = "L"
    state_shape = (batch, dirs, hidden) if layout else (dirs, batch, hidden)
    if states:
        inits += [numpy_helper.from_array(rng.standard_normal(state_shape).astype(np.float32), n) for n in ("H0", "C0")]
        names[5:7] = ["H0", "C0"]
    if peephole:
        inits.append(numpy_helper.from_array(rng.standard_normal((dirs, 3 * hidden)).astype(np.float32), "P"))
        names[7] = "P"
    while names and names[-1] == "":
        names.pop()
    outs = ["Y", "Y_h", "Y_c"][:outputs]
    node = helper.make_node("LSTM", names, outs, hidden_size=hidden, direction=direction, layout=layout, **attrs)
    x_shape = [batch, seq, d_in] if layout else [seq, batch, d_in]
    y_shape = [batch, seq, dirs, hidden] if layout else [seq, dirs, batch, hidden]
    graph = helper.make_graph(
        [node], "lstm", [helper.make_tensor_value_info("X", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, y_shape if o == "Y" else list(state_shape)) for o in outs],
        inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])


def check(model, tol=1e-5, reference=runner.reference_outputs):
    compiled = compile_model(model, "llvm")
    feeds = runner.random_inputs(compiled.model.inputs, 7)
    outs = runner.run_vm(compiled.executable, compiled.model.params, runner.check_feeds(compiled.model.inputs, feeds))
    _, ref = reference(model, feeds)
    for c in runner.compare(compiled.model.outputs, outs, ref):
        assert c.finite and c.rel_l2 < tol, f"{c.name}: rel L2 {c.rel_l2:.2e}"
    return compiled


@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
def test_directions(direction):
    check(lstm_model(direction=direction))


@pytest.mark.parametrize("states", [True, False])
def test_initial_states_and_batch(states):
    check(lstm_model(batch=1, states=states))
    check(lstm_model(batch=4, states=states, seed=2))


def test_peepholes_and_clip_and_input_forget():
    check(lstm_model(peephole=True, direction="bidirectional"))
    check(lstm_model(clip=0.7, seed=3))
    check(lstm_model(input_forget=1, seed=4))


def test_batch_first_layout():
    # onnxruntime refuses layout=1 ("Batchwise recurrent operations are not supported"),
    # so this one case uses ONNX's reference evaluator.
    from onnx.reference import ReferenceEvaluator

    check(lstm_model(layout=1, direction="bidirectional"),
          reference=lambda m, f: ("onnx.reference", ReferenceEvaluator(m).run(None, f)))


def test_custom_activations():
    check(lstm_model(activations=["HardSigmoid", "Tanh", "Relu"], activation_alpha=[0.3], activation_beta=[0.4]))


def test_only_y_output_and_full_sequence_lens_accepted():
    check(lstm_model(outputs=1, seq_lens=[5, 5, 5]))


def test_variable_sequence_lens_is_a_clear_error():
    with pytest.raises(UnsupportedOperatorError, match="sequence_lens"):
        compile_model(lstm_model(seq_lens=[5, 3, 5]), "llvm")


def test_steps_share_kernels():
    """Unrolled steps must not multiply distinct kernels: the per-step PrimFuncs deduplicate."""
    short = compile_model(lstm_model(seq=3), "llvm").report
    long = compile_model(lstm_model(seq=12), "llvm").report
    assert long.distinct_kernels == short.distinct_kernels
    assert long.launches > short.launches


def test_weights_given_at_run_time_are_reordered_in_the_graph():
    """W, R and B as graph inputs: the unit-major gate order (``interleaved``) is then a ``take``
    in the graph, not a constant reordered at import; both against onnxruntime."""
    model = lstm_model(direction="bidirectional")
    graph = model.graph
    weights = [t for t in graph.initializer if t.name in ("W", "R", "B")]
    for t in weights:
        graph.initializer.remove(t)
        graph.input.append(helper.make_tensor_value_info(t.name, TensorProto.FLOAT, list(t.dims)))
    compiled = check(model)
    assert {"W", "R", "B"} <= {i.name for i in compiled.model.inputs}
