"""Older ONNX files: IR version 3, opset 9 (issue 18, class 5).

Early exporters (PyTorch 0.3/0.4, the classic model-zoo CNNs) wrote IR version 3, where every
initializer is also listed among the graph inputs (the initializer is the input's default
value), named tensors by numbers, and made some weights at run time with ``ConstantOfShape``
from an int64 shape initializer. ``old_cnn`` builds such a file with onnx.helper, as those
exporters laid it out (no old exporter is installed here). Before the fix TVM's importer took
each listed initializer as a model input *and* a weight, and the user saw a bare
``'te.PlaceholderOp(name="1", ...)'`` (souffle) or an internal error (tvm).
"""

from __future__ import annotations

import re

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from souffle_tvm.frontend.importer import import_onnx

from conftest import module_cli as cli



def old_cnn(flatten: str = "reshape", seed: int = 0) -> onnx.ModelProto:
    """Conv → BN (gamma from ConstantOfShape) → Relu → 1x1 Conv (weight from ConstantOfShape)
    → MaxPool → flatten → Gemm, at IR version 3 / opset 9. ``flatten``: "reshape" (a constant
    shape initializer) or "shape" (``x.view(x.size(0), -1)`` as torch 0.4 wrote it:
    Shape→Gather→Unsqueeze→Concat→Reshape)."""
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array(a, str(i)) for i, a in enumerate([
        (rng.standard_normal((8, 3, 3, 3)) * 0.2).astype(np.float32),      # "0": conv weight
        (rng.standard_normal(8) * 0.1).astype(np.float32),                  # "1": conv bias
        np.array([8], np.int64),                                            # "2": BN gamma's shape
        (rng.standard_normal(8) * 0.1).astype(np.float32),                  # "3": BN beta
        rng.uniform(-0.5, 0.5, 8).astype(np.float32),                       # "4": running mean
        rng.uniform(0.5, 1.5, 8).astype(np.float32),                        # "5": running var
        np.array([4, 8, 1, 1], np.int64),                                   # "6": 1x1 conv weight's shape
        np.array([2, -1], np.int64),                                        # "7": Reshape's shape
        (rng.standard_normal((10, 64)) * 0.1).astype(np.float32),           # "8": fc weight
        (rng.standard_normal(10) * 0.1).astype(np.float32),                 # "9": fc bias
        np.array(-1, np.int64).reshape(1),                                  # "10": the -1 of view()
    ], start=1)]
    fill = lambda v: numpy_helper.from_array(np.array([v], np.float32))  # noqa: E731
    nodes = [
        helper.make_node("Conv", ["0", "1", "2"], ["20"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("ConstantOfShape", ["3"], ["21"], value=fill(1.5)),
        helper.make_node("BatchNormalization", ["20", "21", "4", "5", "6"], ["22"], epsilon=1e-5),
        helper.make_node("Relu", ["22"], ["23"]),
        helper.make_node("ConstantOfShape", ["7"], ["24"], value=fill(0.125)),
        helper.make_node("Conv", ["23", "24"], ["25"], kernel_shape=[1, 1]),
        helper.make_node("MaxPool", ["25"], ["26"], kernel_shape=[2, 2], strides=[2, 2]),
    ]
    if flatten == "reshape":
        nodes.append(helper.make_node("Reshape", ["26", "8"], ["30"]))
    else:
        nodes += [helper.make_node("Shape", ["26"], ["27"]),
                  helper.make_node("Gather", ["27", "40"], ["28"], axis=0),
                  helper.make_node("Unsqueeze", ["28"], ["29"], axes=[0]),
                  helper.make_node("Concat", ["29", "11"], ["31"], axis=0),
                  helper.make_node("Reshape", ["26", "31"], ["30"])]
        nodes.insert(0, helper.make_node("Constant", [], ["40"], value=numpy_helper.from_array(np.array(0, np.int64))))
    nodes.append(helper.make_node("Gemm", ["30", "9", "10"], ["50"], transB=1))
    # IR version 3: every initializer is also a graph input
    inputs = [helper.make_tensor_value_info("0", TensorProto.FLOAT, [2, 3, 8, 8])] + [
        helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in inits]
    graph = helper.make_graph(nodes, "old_cnn", inputs, [helper.make_tensor_value_info("50", TensorProto.FLOAT, [2, 10])],
                              inits)
    model = helper.make_model(graph, producer_name="pytorch", producer_version="0.4",
                              opset_imports=[helper.make_opsetid("", 9)])
    model.ir_version = 3
    onnx.checker.check_model(model)
    return model


@pytest.mark.parametrize("flatten", ["reshape", "shape"])
def test_the_file_is_an_old_one(flatten):
    model = old_cnn(flatten)
    assert model.ir_version == 3 and model.opset_import[0].version == 9
    assert {t.name for t in model.graph.initializer} <= {vi.name for vi in model.graph.input}
    assert sum(n.op_type == "ConstantOfShape" for n in model.graph.node) == 2


@pytest.mark.parametrize("flatten", ["reshape", "shape"])
def test_listed_initializers_are_weights_not_inputs(flatten):
    m = import_onnx(old_cnn(flatten))
    func = m.mod["main"]
    assert [i.name for i in m.inputs] == ["0"] and int(func.attrs["num_input"]) == 1
    floats = [t for t in old_cnn(flatten).graph.initializer if t.data_type == TensorProto.FLOAT]
    # weights only, each a float tensor of a shape the model's weights have, never an int64
    # shape; where the folding ran ("shape"), the ConstantOfShape results are constants too, and
    # the batch norm is then folded into the conv (frontend/onnx_bn)
    assert len(func.params) == 1 + len(m.params)
    assert all(w.dtype == np.float32 for w in m.params)
    allowed = {tuple(t.dims) for t in floats} | {(4, 8, 1, 1)}
    assert {w.shape for w in m.params} <= allowed, [w.shape for w in m.params]
    if flatten == "reshape":     # no folding: each float initializer once
        assert sorted(w.shape for w in m.params) == sorted(tuple(t.dims) for t in floats)


@pytest.mark.parametrize("flatten,fusion", [("reshape", "tvm"), ("reshape", "souffle"),
                                            pytest.param("shape", "souffle", marks=pytest.mark.slow),
                                            pytest.param("shape", "tvm", marks=pytest.mark.slow)])
def test_old_file_runs_and_matches_onnxruntime(flatten, fusion, tmp_path):
    onnx.save(old_cnn(flatten), tmp_path / "old.onnx")
    proc = cli("run", "old.onnx", "--check", "--seed", "4", "--fusion", fusion, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.strip().startswith("check 50 vs")]
    assert float(re.search(r"rel L2 (\S+)", line).group(1)) < 1e-5, line
