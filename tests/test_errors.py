"""Bad input gets a clear error, never a crash or a silently wrong answer."""

import numpy as np
import pytest
from onnx import TensorProto, helper

from souffle_tvm import zoo
from souffle_tvm.pipeline.driver import compile as compile_model
from souffle_tvm.errors import DynamicShapeError, ModelLoadError, UnsupportedOperatorError
from souffle_tvm.frontend.importer import import_onnx


def test_truncated_file(tmp_path):
    data = zoo.build("mmoe", small=True).SerializeToString()
    path = tmp_path / "cut.onnx"
    path.write_bytes(data[: len(data) // 3])
    with pytest.raises(ModelLoadError, match="truncated or corrupt"):
        import_onnx(str(path))


def test_missing_file_and_garbage(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file"):
        import_onnx(str(tmp_path / "nope.onnx"))
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"this is not a protobuf at all" * 10)
    with pytest.raises(ModelLoadError):
        import_onnx(str(junk))


def _one_node(op, domain=""):
    node = helper.make_node(op, ["x"], ["y"], name="my_node", domain=domain)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    return helper.make_model(graph, opset_imports=opsets)


def test_unknown_operator_names_op_and_node():
    with pytest.raises(UnsupportedOperatorError, match=r"com.example::FancyOp \(node 'my_node'\)"):
        import_onnx(_one_node("FancyOp", domain="com.example"))


def test_operator_tvm_lacks_is_named():
    model = _one_node("LpNormalization")  # a standard op TVM 0.27 has no converter for
    with pytest.raises(UnsupportedOperatorError, match=r"LpNormalization \(node 'my_node'\)"):
        compile_model(model, "llvm")


def test_dynamic_input_dimension():
    model = _one_node("Relu")
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "batch"
    with pytest.raises(DynamicShapeError, match=r"'x'.*dimension 0 \('batch'\)"):
        import_onnx(model)
    fixed = import_onnx(model, shapes={"x": (5, 3)})
    assert fixed.inputs[0].shape == (5, 3)


def test_unlowerable_model_falls_back_to_tvm_and_says_why(monkeypatch):
    from conftest import run_and_compare
    from souffle_tvm.te import program as te_program
    from souffle_tvm.errors import LoweringError

    def refuse(*_a, **_k):
        raise LoweringError("binding 'lv3': result 0 is not a tensor of static shape")

    monkeypatch.setattr(te_program, "lower", refuse)
    c = compile_model("mmoe", "llvm", "souffle", small=True)
    assert c.report.fusion == "souffle" and "not a tensor of static shape" in c.report.fallback
    assert not c.report.groups
    assert "fallback to TVM's default path" in c.report.table()
    for cmp in run_and_compare(c):
        assert cmp.rel_l2 < 1e-5


def test_unknown_level_is_refused():
    with pytest.raises(ValueError, match="unknown level"):
        compile_model("mmoe", "llvm", "souffle", small=True, level="v9")


def test_bad_target_and_arch():
    with pytest.raises(ValueError, match="unsupported target"):
        compile_model("mmoe", "rocm", small=True)
    with pytest.raises(ValueError, match="sm_70"):
        compile_model("mmoe", "cuda", arch="sm_70", small=True)


def test_wrong_input_shape_is_reported():
    from souffle_tvm.runtime import runner
    from souffle_tvm.errors import SouffleError

    m = import_onnx("mmoe", small=True)
    with pytest.raises(SouffleError, match="shape"):
        runner.check_feeds(m.inputs, {"features": np.zeros((2, 2), np.float32)})
    with pytest.raises(SouffleError, match="missing"):
        runner.check_feeds(m.inputs, {})
