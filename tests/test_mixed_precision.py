"""``--dtype float16|bfloat16`` for any model (issue 58, item 1): exported ONNX files (a BERT-style
encoder and a ConvNeXt-style network, from PyTorch's exporter) converted to compute in the low
type, matched on llvm against onnxruntime running the float32 original within a stated bound,
and built for CUDA with nvcc with two-byte elements in the report. A dtype that cannot apply is
refused in one line."""

import subprocess
import sys

import numpy as np
import onnx
import pytest

import torch_models as tm
from souffle_tvm.errors import OptionsError
from souffle_tvm.frontend import precision
from souffle_tvm.pipeline.driver import compile as compile_model
from souffle_tvm.runtime import runner

# relative L2 against the float32 reference: 10 bits of mantissa (float16), 7 (bfloat16)
BOUND = {"float16": 1e-2, "bfloat16": 5e-2}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", ["bert", "convnext"])
def test_an_exported_model_in_low_precision_matches_its_float32_reference(name, dtype):
    path = tm.export(name, "legacy")
    compiled = compile_model(path, "llvm", "souffle", dtype=dtype, shapes=tm.input_shapes(name))
    assert compiled.model.precision == dtype
    # weights (matrices and kernels) stored in the low type; a norm's scale cast up to float32 for it
    # may fold to a float32 vector
    weights = [p for p in compiled.model.params if p.ndim >= 2 and (p.dtype.kind == "f" or str(p.dtype) == "bfloat16")]
    assert weights and all(str(p.dtype) == dtype for p in weights), [(p.shape, p.dtype) for p in weights]
    feeds = tm.example_inputs(name)
    ordered = [feeds[i.name] for i in compiled.model.inputs]
    assert all(i.dtype != dtype for i in compiled.model.inputs)             # inputs stay as exported
    outs = runner.run_vm(compiled.executable, compiled.model.params, ordered)
    _, ref = runner.reference_outputs(compiled.model.onnx_model, feeds)     # the float32 original
    for c in runner.compare(compiled.model.outputs, outs, ref):
        assert c.finite and c.rel_l2 < BOUND[dtype], (c.name, c.rel_l2)
        assert c.rel_l2 > 1e-6, "as close as float32: the model was not converted"
    assert all(o.dtype == np.float32 for o in outs)


@pytest.mark.parametrize("name,dtype", [("bert", "float16"), ("convnext", "bfloat16"),
                                        pytest.param("bert", "bfloat16", marks=pytest.mark.slow),
                                        pytest.param("convnext", "float16", marks=pytest.mark.slow)])
def test_it_builds_for_cuda_with_two_byte_elements(name, dtype):
    path = tm.export(name, "legacy")
    report = compile_model(path, "cuda", "souffle", dtype=dtype, shapes=tm.input_shapes(name)).report
    assert report.nvcc.get("available"), report.nvcc
    sizes = [k.elem_bytes for k in report.kernels if k.flops and k.elem_bytes]
    assert sizes and sizes.count(2) > len(sizes) // 2, sizes


def test_the_sensitive_operators_stay_in_float32():
    model = onnx.load(tm.export("bert", "legacy"))
    low = precision.convert(model, "bfloat16")
    kept = [n for n in low.graph.node if n.op_type in precision.KEPT_FLOAT32]
    assert {n.op_type for n in kept} >= {"Softmax"}, "the encoder's softmax"
    made = {o: n for n in low.graph.node for o in n.output}
    used = {i: n for n in low.graph.node for i in n.input}
    for node in kept:      # data in through a Cast up to float32, out through a Cast down
        up, down = made[node.input[0]], used[node.output[0]]
        assert up.op_type == "Cast" and up.attribute[0].i == onnx.TensorProto.FLOAT, node
        assert down.op_type == "Cast" and down.attribute[0].i == onnx.TensorProto.BFLOAT16, node
    assert not any(t.data_type == onnx.TensorProto.FLOAT for t in low.graph.initializer)


def test_run_check_holds_a_converted_model_to_its_precisions_bound(tmp_path):
    path = tm.export("convnext", "legacy")
    out = subprocess.run([sys.executable, "-m", "souffle_tvm.cli", "run", path, "--fusion", "souffle", "--dtype",
                          "bfloat16", "--input-shapes", "x:2x3x32x32", "--check"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert " ok" in out.stdout and "vs onnxruntime" in out.stdout


def test_a_dtype_that_cannot_apply_is_refused():
    with pytest.raises(OptionsError, match="one of float32, float16, bfloat16"):
        precision.convert(onnx.load(tm.export("convnext", "legacy")), "float64")
    fp16 = compile_model("bert", "llvm", "souffle", small=True, dtype="float16")   # the zoo's native float16
    with pytest.raises(OptionsError, match="nothing in float32"):
        precision.convert(fp16.model.onnx_model, "bfloat16")
    out = subprocess.run([sys.executable, "-m", "souffle_tvm.cli", "compile", "bert", "--small", "--dtype", "float64"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1 and "float64" in out.stderr
