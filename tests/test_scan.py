"""ONNX ``Scan`` of static length, unrolled by ``onnx_control``, against onnxruntime.

Each model is built by hand (opset 17; the first also at 11 and 18): one state and one scan input, reversed directions,
non-zero and negative scan axes, two states and two scan inputs reading an outer weight, and
the errors for a run-time length and for a length over the unroll limit.
"""

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from souffle_tvm.runtime import runner
from souffle_tvm.pipeline.driver import compile as compile_model
from souffle_tvm.errors import UnsupportedOperatorError
from souffle_tvm.frontend.importer import import_onnx
from souffle_tvm.frontend.onnx_control import MAX_UNROLL

F, I64 = TensorProto.FLOAT, TensorProto.INT64


def _vi(name, shape, elem=F):
    return helper.make_tensor_value_info(name, elem, shape)


def _model(nodes, inputs, outputs, inits=(), opset=17):
    """``outputs``: name -> rank (dims left to shape inference)."""
    outs = [_vi(name, [f"{name}_{k}" for k in range(rank)]) for name, rank in outputs.items()]
    graph = helper.make_graph(nodes, "g", inputs, outs, list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def check(model, seed=0, tol=1e-5):
    compiled = compile_model(model, "llvm", "tvm")
    assert "Scan" not in str(compiled.model.mod)
    feeds = runner.random_inputs(compiled.model.inputs, seed)
    outs = runner.run_vm(compiled.executable, compiled.model.params, runner.check_feeds(compiled.model.inputs, feeds))
    _, ref = runner.reference_outputs(model, feeds)
    errors = {}
    for c in runner.compare(compiled.model.outputs, outs, ref):
        assert c.finite and c.rel_l2 < tol, f"{c.name}: rel L2 {c.rel_l2:.2e}"
        errors[c.name] = c.rel_l2
    print(f"max rel L2 vs onnxruntime: {max(errors.values()):.2e} {errors}")
    return compiled


def _rnn_body():
    """h' = tanh(0.5 h + x_t); the scan output is h'."""
    return helper.make_graph(
        [helper.make_node("Mul", ["h", "half"], ["hh"]), helper.make_node("Add", ["hh", "xt"], ["pre"]),
         helper.make_node("Tanh", ["pre"], ["h_out"]), helper.make_node("Identity", ["h_out"], ["y_t"])],
        "rnn", [_vi("h", None), _vi("xt", None)], [_vi("h_out", None), _vi("y_t", None)],
        [numpy_helper.from_array(np.float32(0.5), "half")])


def _cumsum_body():
    """s' = s + x_t; the scan output is s' (a running sum, so every direction shows)."""
    return helper.make_graph(
        [helper.make_node("Add", ["s", "xt"], ["s_out"]), helper.make_node("Identity", ["s_out"], ["y_t"])],
        "cumsum", [_vi("s", None), _vi("xt", None)], [_vi("s_out", None), _vi("y_t", None)])


def _one_state(body, x_shape, state_shape, opset=17, **attrs):
    node = helper.make_node("Scan", ["s0", "x"], ["s_last", "ys"], name="the_scan", body=body, num_scan_inputs=1,
                            **attrs)
    return _model([node], [_vi("s0", state_shape), _vi("x", x_shape)],
                  {"s_last": len(state_shape), "ys": len(x_shape)}, opset=opset)


# Squeeze/Unsqueeze take axes as attributes before opset 13; Split needs num_outputs from 18.
@pytest.mark.parametrize("opset", [11, 17, 18])
def test_scan_rnn_one_state_unrolls(opset):
    compiled = check(_one_state(_rnn_body(), [5, 2, 3], [2, 3], opset=opset))
    assert [int(d) for d in compiled.model.mod["main"].ret_ty.fields[1].shape] == [5, 2, 3]


@pytest.mark.parametrize("in_dir,out_dir", [(1, 0), (0, 1), (1, 1)])
def test_scan_reverse_directions(in_dir, out_dir):
    check(_one_state(_cumsum_body(), [4, 3], [3], scan_input_directions=[in_dir], scan_output_directions=[out_dir]))


@pytest.mark.parametrize("in_axis,out_axis,out_shape", [(1, -1, [2, 3, 5]), (-2, 1, [2, 5, 3]), (-1, 0, [3, 2, 5])])
def test_scan_non_zero_axes(in_axis, out_axis, out_shape):
    # x is (2, 5, 3): steps of (2, 3) along axis 1 (= -2), of (2, 5) along axis -1.
    state = [2, 3] if in_axis in (1, -2) else [2, 5]
    compiled = check(_one_state(_cumsum_body(), [2, 5, 3], state, scan_input_axes=[in_axis],
                                scan_output_axes=[out_axis]))
    assert [int(d) for d in compiled.model.mod["main"].ret_ty.fields[1].shape] == out_shape


def test_scan_two_states_two_inputs_outer_weight():
    """h' = tanh(h W + a_t), c' = c + b_t * h'; ys = h' (forward, axis 0), zs = c' (reverse, axis 1).
    b is scanned along axis 1 in reverse; W is an initializer of the outer graph."""
    body = helper.make_graph(
        [helper.make_node("MatMul", ["h", "W"], ["hw"]), helper.make_node("Add", ["hw", "a_t"], ["pre"]),
         helper.make_node("Tanh", ["pre"], ["h_out"]), helper.make_node("Mul", ["b_t", "h_out"], ["bh"]),
         helper.make_node("Add", ["c", "bh"], ["c_out"]), helper.make_node("Identity", ["h_out"], ["y_t"]),
         helper.make_node("Identity", ["c_out"], ["z_t"])],
        "body", [_vi("h", None), _vi("c", None), _vi("a_t", None), _vi("b_t", None)],
        [_vi("h_out", None), _vi("c_out", None), _vi("y_t", None), _vi("z_t", None)])
    node = helper.make_node("Scan", ["h0", "c0", "a", "b"], ["h_last", "c_last", "ys", "zs"], name="the_scan",
                            body=body, num_scan_inputs=2, scan_input_axes=[0, 1], scan_input_directions=[0, 1],
                            scan_output_axes=[0, 1], scan_output_directions=[0, 1])
    w = np.random.default_rng(1).standard_normal((4, 4)).astype(np.float32) * 0.5
    model = _model([node], [_vi("h0", [2, 4]), _vi("c0", [2, 4]), _vi("a", [6, 2, 4]), _vi("b", [2, 6, 4])],
                   {"h_last": 2, "c_last": 2, "ys": 3, "zs": 3}, [numpy_helper.from_array(w, "W")])
    compiled = check(model)
    assert [[int(d) for d in f.shape] for f in compiled.model.mod["main"].ret_ty.fields] == \
        [[2, 4], [2, 4], [6, 2, 4], [2, 6, 4]]


def test_scan_run_time_length_names_node_and_input():
    # xs = x[:n] with n a model input: the sequence length is data.
    slice_ = helper.make_node("Slice", ["x", "zero", "n", "zero"], ["xs"], name="take_n")
    node = helper.make_node("Scan", ["s0", "xs"], ["s_last", "ys"], name="the_scan", body=_cumsum_body(),
                            num_scan_inputs=1)
    model = _model([slice_, node], [_vi("s0", [3]), _vi("x", [5, 3]), _vi("n", [1], I64)], {"s_last": 1, "ys": 2},
                   [numpy_helper.from_array(np.array([0], np.int64), "zero")])
    with pytest.raises(UnsupportedOperatorError,
                       match=r"'the_scan' \(Scan\): the length of its scan input 'xs' is not static "
                             r"\(computed at run time from model input\(s\) 'n'\)"):
        import_onnx(model)


def test_scan_over_the_unroll_limit_is_named():
    model = _one_state(_cumsum_body(), [MAX_UNROLL + 1, 2], [2])
    with pytest.raises(UnsupportedOperatorError, match=rf"'the_scan' \(Scan\): {MAX_UNROLL + 1} iterations .*'x'.*"
                                                       rf"unroll limit {MAX_UNROLL}"):
        import_onnx(model)
