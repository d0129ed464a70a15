"""`souffle-tvm run --inputs/--outputs` end to end through the installed entry point: integer,
boolean and 0-d inputs, several outputs of several dtypes, dynamic dims taken from the arrays."""

import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from souffle_tvm.runtime import runner

CLI = os.path.join(os.path.dirname(sys.executable), "souffle-tvm")
BOOL, F, I64 = TensorProto.BOOL, TensorProto.FLOAT, TensorProto.INT64


def mixed_io_model() -> onnx.ModelProto:
    """ids int64 [batch, 4], mask bool [batch, 4], scale float 0-d → embeddings masked and
    flattened by a Shape→Concat→Reshape chain (float), per-row counts (int64), ~mask (bool)."""
    table = np.random.default_rng(0).standard_normal((10, 3)).astype(np.float32)
    nodes = [
        helper.make_node("Gather", ["table", "ids"], ["e"]),
        helper.make_node("Mul", ["e", "scale"], ["es"]),
        helper.make_node("Unsqueeze", ["mask", "ax2"], ["m3"]),
        helper.make_node("Where", ["m3", "es", "zero_f"], ["masked"]),
        helper.make_node("Shape", ["ids"], ["s"]),
        helper.make_node("Gather", ["s", "zero"], ["b"], axis=0),
        helper.make_node("Unsqueeze", ["b", "ax0"], ["b1"]),
        helper.make_node("Concat", ["b1", "minus1"], ["newshape"], axis=0),
        helper.make_node("Reshape", ["masked", "newshape"], ["flat"]),
        helper.make_node("Cast", ["mask"], ["mi"], to=I64),
        helper.make_node("ReduceSum", ["mi", "ax1"], ["count"], keepdims=0),
        helper.make_node("Not", ["mask"], ["inverted"]),
    ]
    inits = [numpy_helper.from_array(table, "table"), numpy_helper.from_array(np.float32(0), "zero_f"),
             numpy_helper.from_array(np.int64(0), "zero"), numpy_helper.from_array(np.array([0], np.int64), "ax0"),
             numpy_helper.from_array(np.array([1], np.int64), "ax1"), numpy_helper.from_array(np.array([2], np.int64), "ax2"),
             numpy_helper.from_array(np.array([-1], np.int64), "minus1")]
    graph = helper.make_graph(
        nodes, "mixed",
        [helper.make_tensor_value_info("ids", I64, ["batch", 4]), helper.make_tensor_value_info("mask", BOOL, ["batch", 4]),
         helper.make_tensor_value_info("scale", F, [])],
        [helper.make_tensor_value_info("flat", F, ["batch", 12]), helper.make_tensor_value_info("count", I64, ["batch"]),
         helper.make_tensor_value_info("inverted", BOOL, ["batch", 4])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _feeds(batch: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"ids": rng.integers(0, 10, (batch, 4)).astype(np.int64), "mask": rng.random((batch, 4)) < 0.6,
            "scale": np.array(1.5 + seed, np.float32)}


def _run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([CLI, "run", *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixed") / "mixed.onnx"
    onnx.save(mixed_io_model(), str(path))
    return path


@pytest.mark.parametrize("batch", [2, 5])
def test_run_with_integer_bool_and_scalar_inputs(model_path, tmp_path, batch):
    feeds = _feeds(batch, batch)
    np.savez(tmp_path / "in.npz", **feeds)
    res = _run(str(model_path), "--inputs", str(tmp_path / "in.npz"), "--outputs", str(tmp_path / "out.npz"), "--check")
    assert res.returncode == 0, res.stderr + res.stdout
    got = np.load(tmp_path / "out.npz")
    assert sorted(got.files) == ["count", "flat", "inverted"]
    _, ref = runner.reference_outputs(mixed_io_model(), feeds)
    for name, want in zip(["flat", "count", "inverted"], ref):
        assert got[name].dtype == want.dtype and got[name].shape == want.shape == got[name].shape
        np.testing.assert_allclose(got[name], want, rtol=1e-6)
    assert got["count"].tolist() == feeds["mask"].sum(1).tolist()


def test_static_input_of_the_wrong_shape_is_a_clear_error(model_path, tmp_path):
    feeds = _feeds(2, 0)
    feeds["scale"] = np.ones((2,), np.float32)   # the model declares scale 0-d: no silent recompile
    np.savez(tmp_path / "in.npz", **feeds)
    res = _run(str(model_path), "--inputs", str(tmp_path / "in.npz"))
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "input 'scale' has shape (2,), the model expects ()" in res.stderr


def test_dynamic_model_without_inputs_or_shapes_says_how(model_path):
    res = _run(str(model_path))
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "dynamic dimension 0 ('batch')" in res.stderr
