"""Folding exporters' run-time shape arithmetic and constant control flow before TVM's import.

Each model is the pattern an exporter writes, built by hand with a dynamic batch dim; the
first test of each pair shows plain TVM import failing on it, so a pass here means folding.
"""

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from souffle_tvm.runtime import runner
from souffle_tvm.pipeline.driver import compile as compile_model
from souffle_tvm.errors import DynamicShapeError, SouffleError, UnsupportedOperatorError
from souffle_tvm.frontend.importer import import_onnx

F, I64 = TensorProto.FLOAT, TensorProto.INT64


def _const(name, value):
    return numpy_helper.from_array(np.asarray(value), name)


def _out(name, rank, elem=F):
    """An output whose dims are left to shape inference (symbolic), as exporters often write them."""
    return helper.make_tensor_value_info(name, elem, [f"{name}_{k}" for k in range(rank)])


def _model(nodes, inputs, outputs, inits=(), opset=17):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def check(model, shapes, tol=1e-5, fusion="tvm"):
    compiled = compile_model(model, "llvm", fusion, shapes=shapes)
    assert fusion == "tvm" or compiled.report.fallback is None, compiled.report.fallback
    feeds = runner.random_inputs(compiled.model.inputs, 3)
    outs = runner.run_vm(compiled.executable, compiled.model.params, runner.check_feeds(compiled.model.inputs, feeds))
    _, ref = runner.reference_outputs(model, feeds)
    assert len(outs) == len(ref)
    for c in runner.compare(compiled.model.outputs, outs, ref):
        assert c.finite and c.rel_l2 < tol, f"{c.name}: rel L2 {c.rel_l2:.2e}"
    return compiled


def shape_reshape_model():
    """x.view(x.size(0), -1, 2) as the legacy exporter writes it: Shape→Gather→Unsqueeze→Concat→Reshape,
    then zeros_like-by-shape (ConstantOfShape(Shape(y))) added, and pads computed from the shape."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "zero"], ["b"], axis=0),
        helper.make_node("Unsqueeze", ["b", "ax0"], ["b1"]),
        helper.make_node("Concat", ["b1", "minus1", "two"], ["newshape"], axis=0),
        helper.make_node("Reshape", ["x", "newshape"], ["y"], name="the_reshape"),
        helper.make_node("Shape", ["y"], ["ys"]),
        helper.make_node("ConstantOfShape", ["ys"], ["ones"], value=numpy_helper.from_array(np.array([1.0], np.float32))),
        helper.make_node("Add", ["y", "ones"], ["z"]),
        # pad the last-but-one axis up to a multiple of 4: (4 - n % 4) % 4, n from the shape
        helper.make_node("Gather", ["ys", "one"], ["n"], axis=0),
        helper.make_node("Mod", ["n", "four"], ["r"]),
        helper.make_node("Sub", ["four", "r"], ["r2"]),
        helper.make_node("Mod", ["r2", "four"], ["p"]),
        helper.make_node("Unsqueeze", ["p", "ax0"], ["p1"]),
        helper.make_node("Concat", ["zeros3", "zero1", "p1", "zero1"], ["pads"], axis=0),
        helper.make_node("Pad", ["z", "pads"], ["out"], name="the_pad"),
    ]
    inits = [_const("zero", np.int64(0)), _const("one", np.int64(1)), _const("four", np.int64(4)),
             _const("ax0", np.array([0], np.int64)), _const("minus1", np.array([-1], np.int64)),
             _const("two", np.array([2], np.int64)), _const("zeros3", np.zeros(3, np.int64)),
             _const("zero1", np.zeros(1, np.int64))]
    return _model(nodes, [helper.make_tensor_value_info("x", F, ["batch", 3, 6])],
                  [_out("out", 3)], inits)


def test_plain_tvm_import_fails_on_shape_arithmetic():
    with pytest.raises(SouffleError, match="TVM's ONNX importer failed"):
        import_onnx(shape_reshape_model(), shapes={"x": (2, 3, 6)}, fold=False)


@pytest.mark.parametrize("batch", [1, 3])
def test_shape_arithmetic_folds_and_matches_onnxruntime(batch):
    compiled = check(shape_reshape_model(), {"x": (batch, 3, 6)})
    # 18 / 2 = 9 rows, padded to 12: the Pad amount was folded from the shape, not guessed.
    assert [int(d) for d in compiled.model.mod["main"].ret_ty.shape] == [batch, 12, 2]


def test_data_dependent_shape_names_node_and_input():
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["y"], name="reshape_by_data")]
    model = _model(nodes, [helper.make_tensor_value_info("x", F, [2, 6]),
                           helper.make_tensor_value_info("shape", I64, [2])],
                   [_out("y", 2)])
    with pytest.raises(DynamicShapeError, match=r"'reshape_by_data' \(Reshape\): its shape input 'shape'.*"
                                                r"model input\(s\) 'shape'"):
        import_onnx(model)


def _if_model(cond_from_shape: bool):
    """y = x * 2 if <cond> else x - 1; <cond> = x.shape[0] > 1 (foldable) or a bool input."""
    then_g = helper.make_graph([helper.make_node("Mul", ["x", "c2"], ["t"])], "then", [],
                               [_out("t", 2)], [_const("c2", np.float32(2))])
    else_g = helper.make_graph([helper.make_node("Sub", ["x", "c1"], ["e"])], "else", [],
                               [_out("e", 2)], [_const("c1", np.float32(1))])
    nodes, inputs = [], [helper.make_tensor_value_info("x", F, ["batch", 4])]
    if cond_from_shape:
        nodes += [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Gather", ["s", "zero"], ["b"], axis=0),
                  helper.make_node("Greater", ["b", "one"], ["cond"])]
    else:
        inputs.append(helper.make_tensor_value_info("cond", TensorProto.BOOL, []))
    nodes.append(helper.make_node("If", ["cond"], ["y"], name="branch", then_branch=then_g, else_branch=else_g))
    return _model(nodes, inputs, [_out("y", 2)],
                  [_const("zero", np.int64(0)), _const("one", np.int64(1))])


@pytest.mark.parametrize("batch", [1, 2])
def test_if_on_a_shape_inlines_the_taken_branch(batch):
    compiled = check(_if_model(True), {"x": (batch, 4)})
    assert "If" not in str(compiled.model.mod)


def test_if_on_run_time_data_names_the_node():
    with pytest.raises(UnsupportedOperatorError, match=r"'branch' \(If\): its condition does not fold.*'cond'"):
        import_onnx(_if_model(False), shapes={"x": (2, 4)})


def _loop_model(trip_from_input: bool):
    """A Loop that runs x.shape[0] + 1 times (or a given count): acc = acc * 0.5 + x, and scans acc."""
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]),
         helper.make_node("Mul", ["acc", "half"], ["h"]),
         helper.make_node("Cast", ["i"], ["fi"], to=F),
         helper.make_node("Add", ["h", "x"], ["acc2"]),
         helper.make_node("Add", ["acc2", "fi"], ["acc_out"]),
         helper.make_node("Identity", ["acc_out"], ["scan"])],
        "body", [helper.make_tensor_value_info("i", I64, []), helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
                 _out("acc", 2)],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []), _out("acc_out", 2),
         _out("scan", 2)], [_const("half", np.float32(0.5))])
    inputs = [helper.make_tensor_value_info("x", F, ["batch", 3])]
    nodes = []
    if trip_from_input:
        inputs.append(helper.make_tensor_value_info("trips", I64, []))
    else:
        nodes += [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Gather", ["s", "zero"], ["b"], axis=0),
                  helper.make_node("Add", ["b", "one"], ["trips"])]
    nodes.append(helper.make_node("Loop", ["trips", "true", "x"], ["final", "scans"], name="the_loop", body=body))
    return _model(nodes, inputs, [_out("final", 2),
                                  _out("scans", 3)],
                  [_const("zero", np.int64(0)), _const("one", np.int64(1)), _const("true", np.bool_(True))])


def test_loop_with_folded_trip_count_unrolls():
    compiled = check(_loop_model(False), {"x": (2, 3)})
    assert [int(d) for d in compiled.model.mod["main"].ret_ty.fields[1].shape] == [3, 2, 3]


def test_loop_with_run_time_trip_count_names_the_node():
    with pytest.raises(SouffleError, match=r"'the_loop' \(Loop\).*'trips'"):
        import_onnx(_loop_model(True), shapes={"x": (2, 3)})


def test_loop_body_with_if_on_the_counter_reads_each_copys_values():
    """acc = acc + x, doubled on the first iteration only: If(i == 0) inside the body, whose branches
    read the body's ``pre``. Only after unrolling is the condition constant; each copy's inlined
    branch must then read that copy's ``pre``."""
    then_g = helper.make_graph([helper.make_node("Mul", ["pre", "two"], ["t"])], "then", [], [_out("t", 2)],
                               [_const("two", np.float32(2))])
    else_g = helper.make_graph([helper.make_node("Identity", ["pre"], ["e"])], "else", [], [_out("e", 2)])
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]), helper.make_node("Add", ["acc", "x"], ["pre"]),
         helper.make_node("Equal", ["i", "zero"], ["first"]),
         helper.make_node("If", ["first"], ["acc_out"], then_branch=then_g, else_branch=else_g)],
        "body", [helper.make_tensor_value_info("i", I64, []),
                 helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []), _out("acc", 2)],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []), _out("acc_out", 2)])
    nodes = [helper.make_node("Loop", ["trips", "true", "x"], ["final"], name="the_loop", body=body)]
    model = _model(nodes, [helper.make_tensor_value_info("x", F, [2, 3])], [_out("final", 2)],
                   [_const("trips", np.int64(3)), _const("zero", np.int64(0)), _const("true", np.bool_(True))])
    assert "If" not in str(check(model, {"x": (2, 3)}).model.mod)


def test_external_data_loads_and_missing_data_file_is_clear(tmp_path):
    import onnx

    w = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
    model = _model([helper.make_node("MatMul", ["x", "w"], ["y"])], [helper.make_tensor_value_info("x", F, [2, 64])],
                   [helper.make_tensor_value_info("y", F, [2, 64])], [_const("w", w)])
    path = tmp_path / "m.onnx"
    # As PyTorch's dynamo exporter writes models: the weights in a file beside the graph.
    onnx.save(model, str(path), save_as_external_data=True, location="m.onnx.data", size_threshold=0)
    m = import_onnx(str(path))
    np.testing.assert_array_equal(m.params[0], w)
    (tmp_path / "m.onnx.data").unlink()
    with pytest.raises(SouffleError, match="separate file"):
        import_onnx(str(path))


def test_unused_input_survives_folding():
    # onnxslim drops graph inputs nothing reads; callers still pass every declared input.
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Reshape", ["x", "s"], ["y"])]
    model = _model(nodes, [helper.make_tensor_value_info("x", F, ["b", 3]), helper.make_tensor_value_info("unused", F, [2])],
                   [_out("y", 2)])
    compiled = check(model, {"x": (4, 3)})
    assert [i.name for i in compiled.model.inputs] == ["x", "unused"]
    assert len(compiled.model.mod["main"].params) == 2
