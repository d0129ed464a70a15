"""ONNX's conformance suite (onnx.backend.test.BackendTest) over souffle-tvm's ONNX backend, llvm.

Default: a quick subset of node tests across ops, both fusions, each with the outcome it must
have; the subset holds the regression tests of the bugs the full suite found (each named below).
`make test-all` (slow) runs all of it through `python -m souffle_experiments conformance`: no crash, no wrong answer.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
from onnx import TensorProto as T
from onnx import helper as h

from conftest import needs_nvcc
from souffle_tvm.errors import UnsupportedOperatorError
from souffle_tvm.pipeline import onnx_backend

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PASS = [
    "test_add_bcast_cpu", "test_relu_cpu", "test_matmul_2d_cpu", "test_gemm_default_no_bias_cpu",
    "test_conv_with_strides_padding_cpu", "test_maxpool_2d_pads_cpu", "test_softmax_axis_1_cpu",
    "test_layer_normalization_2d_axis0_expanded_cpu", "test_transpose_all_permutations_2_cpu",
    "test_concat_3d_axis_negative_2_cpu", "test_gather_0_cpu", "test_where_example_cpu",
    "test_operator_reduced_mean_keepdim_cpu", "test_split_equal_parts_2d_cpu",
    "test_cast_FLOAT16_to_DOUBLE_cpu", "test_lstm_defaults_cpu", "test_Linear_cpu",
    # regression tests of the bugs the full suite found
    "test_shape_cpu", "test_shape_start_greater_than_end_cpu",       # a static shape output (ShapeTuple)
    "test_argmax_keepdims_random_cpu",                                  # souffle: a tuple reduction rebuilt
    "test_PReLU_2d_multiparam_cpu",                                     # opset 6: a 1-D slope per channel
    "test_mod_float_edge_cases_fmod_0_float32_cpu",                     # x mod inf
    "test_isinf_negative_cpu",                                          # detect_negative=0
    "test_mish_cpu",                                                    # log(1 + tiny)
    "test_bitshift_right_int32_negative_shift_cpu",                     # a shift out of range
    "test_sequence_model3_cpu",                                         # SequenceInsert at -1
    "test_attention_23_boolmask_fullymasked_row_nan_robustness_expanded_cpu",   # ReduceMax of -inf
    "test_attention_4d_fp16_expanded_cpu",                              # float16: float32 accumulation
]

UNSUPPORTED = {
    "test_batchnorm_epsilon_training_mode_cpu": "training mode",
    "test_dropout_default_mask_cpu": "mask output is used",
    "test_layer_normalization_2d_axis0_cpu": "Mean/InvStdDev",
    "test_cast_FLOAT_to_FLOAT8E5M2_cpu": "FLOAT8E5M2",
    "test_convtranspose_output_shape_cpu": "output_shape",
    "test_pow_types_int32_int32_cpu": "integer base",
    "test_roialign_mode_max_cpu": "mode='max'",
    "test_spacetodepth_crd_mode_example_cpu": "CRD",
    "test_rms_normalization_2d_axis0_cpu": "every axis",
    "test_nonmaxsuppression_two_batches_cpu": "depends on the input values",
    "test_col2im_cpu": "Col2Im",
}


@functools.cache
def _tests(fusion: str) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return onnx_backend.conformance_tests(fusion)


@pytest.mark.parametrize("fusion", onnx_backend.FUSIONS)
@pytest.mark.parametrize("name", PASS)
def test_passes(name, fusion):
    outcome, message = onnx_backend.run_conformance_test(_tests(fusion)[name])
    assert outcome == "pass", message


@pytest.mark.parametrize("fusion", onnx_backend.FUSIONS)
@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_refused_clearly(name, fusion):
    outcome, message = onnx_backend.run_conformance_test(_tests(fusion)[name])
    assert outcome == "unsupported" and UNSUPPORTED[name] in message, message


def test_backend_interface():
    assert onnx_backend.SouffleBackend.supports_device("CPU")
    assert not onnx_backend.SouffleBackend.supports_device("CUDA")
    x = h.make_tensor_value_info("x", T.FLOAT, [2, 3])
    y = h.make_tensor_value_info("y", T.FLOAT, [2, 3])
    model = h.make_model(h.make_graph([h.make_node("Relu", ["x"], ["y"])], "g", [x], [y]),
                         opset_imports=[h.make_opsetid("", 17)])
    a = np.array([[-1, 0, 2], [3, -4, 5]], np.float32)
    for fusion in onnx_backend.FUSIONS:
        (out,) = onnx_backend.prepare(model, "CPU", fusion=fusion).run([a])
        np.testing.assert_array_equal(out, np.maximum(a, 0))
    with pytest.raises(UnsupportedOperatorError):
        onnx_backend.SouffleBackend.run_node(model.graph.node[0], [a])


def test_fp16_accumulation_is_an_import_option():
    """The backend imports float16 contractions accumulating in float32 (ONNX's reference does);
    a plain import keeps them in float16."""
    from souffle_tvm.frontend.importer import import_onnx

    a = h.make_tensor_value_info("a", T.FLOAT16, [4, 64])
    b = h.make_tensor_value_info("b", T.FLOAT16, [64, 4])
    y = h.make_tensor_value_info("y", T.FLOAT16, [4, 4])
    model = h.make_model(h.make_graph([h.make_node("MatMul", ["a", "b"], ["y"])], "g", [a, b], [y]),
                         opset_imports=[h.make_opsetid("", 17)])
    assert "float32" not in import_onnx(model).mod.script()
    assert "float32" in import_onnx(model, fp16_accumulation="float32").mod.script()
    with pytest.raises(ValueError):
        import_onnx(model, fp16_accumulation="bf16")


def test_reduce_max_of_all_minus_infinity():
    """TVM's max reduction starts at the lowest finite float: a row of -inf reduced to -3.4e38."""
    x = h.make_tensor_value_info("x", T.FLOAT, [2, 4])
    nodes = [h.make_node("ReduceMax", ["x"], ["mx"], keepdims=1, axes=[-1]),
             h.make_node("Neg", ["x"], ["n"]),
             h.make_node("ReduceMin", ["n"], ["mn"], keepdims=0, axes=[1])]
    outs = [h.make_tensor_value_info("mx", T.FLOAT, [2, 1]), h.make_tensor_value_info("mn", T.FLOAT, [2])]
    model = h.make_model(h.make_graph(nodes, "g", [x], outs), opset_imports=[h.make_opsetid("", 13)])
    a = np.array([[-np.inf] * 4, [0, 1, 2, 3]], np.float32)
    mx, mn = onnx_backend.prepare(model).run([a])
    np.testing.assert_array_equal(mx, [[-np.inf], [3]])
    np.testing.assert_array_equal(mn, [np.inf, -3])


@pytest.mark.slow
def test_whole_suite_no_crash_no_wrong_answer(tmp_path):
    """All of BackendTest, both fusions: `souffle_experiments conformance` exits 1 on any crash or wrong answer."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "souffle_experiments", "conformance",
                           "--out", str(tmp_path / "conformance")], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


@needs_nvcc
@pytest.mark.slow
def test_model_tests_build_for_cuda_at_the_default_level(tmp_path):
    """BackendTest's model tests (simple, pytorch-converted, pytorch-operator; the 224x224 "real"
    CNNs by hand, see souffle_experiments/onnx_models_cuda.py) built for CUDA at the default level with nvcc:
    the script exits 1 on any that fails other than with the project's clear refusal."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "souffle_experiments", "onnx-models-cuda",
                           "--out", str(tmp_path / "models.md")], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
