"""CNN exports that keep inference ``BatchNormalization`` (issue 18, class 3).

torch's legacy exporter folds batch norm into the conv unless constant folding is off; with it
off (as TF/Keras and older exports also leave it) the graph has Conv→BatchNormalization→Relu.
``frontend.onnx_bn`` folds each batch norm that follows a conv with constant weights into the
conv's weights and bias at compile time, so the model builds to the same kernels as the
Conv(+bias)→Relu model with those folded weights, and matches onnxruntime on the unfolded file.
The exporter matrix's CNNs (ResNeXt, EfficientNet) exported with their batch norms kept, by
either exporter, fold to the graphs the exporters write by default and match onnxruntime.
"""

from __future__ import annotations

import contextlib
import io
import warnings

import numpy as np
import onnx
import pytest
import torch
from torch import nn

import torch_models as tm
from souffle_tvm.frontend import onnx_bn, onnx_fold
from souffle_tvm.pipeline.driver import compile as compile_model
from souffle_tvm.runtime import runner


class ConvBNRelu(nn.Module):
    def __init__(self, bn: bool):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=not bn)
        self.bn = nn.BatchNorm2d(8) if bn else nn.Identity()
        self.head = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.conv(x))))


def _export(model: nn.Module, path: str, fold: bool) -> None:
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.randn(2, 3, 16, 16),), path, input_names=["x"], output_names=["y"],
                          opset_version=17, dynamo=False, do_constant_folding=fold,
                          training=torch.onnx.TrainingMode.EVAL)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[str, str]:
    """(Conv→BN→Relu→Conv export with the batch norm kept, the equivalent Conv→Relu→Conv)."""
    folder = tmp_path_factory.mktemp("bn")
    torch.manual_seed(0)
    with_bn = ConvBNRelu(True).eval()
    with torch.no_grad():   # statistics and affine parameters that change the result
        with_bn.bn.running_mean.uniform_(-0.5, 0.5)
        with_bn.bn.running_var.uniform_(0.5, 1.5)
        with_bn.bn.weight.uniform_(0.5, 1.5)
        with_bn.bn.bias.uniform_(-0.2, 0.2)
    plain = ConvBNRelu(False).eval()
    with torch.no_grad():
        bn = with_bn.bn
        s = bn.weight / torch.sqrt(bn.running_var + bn.eps)
        plain.conv.weight.copy_(with_bn.conv.weight * s[:, None, None, None])
        plain.conv.bias.copy_(bn.bias - bn.running_mean * s)
        plain.head.load_state_dict(with_bn.head.state_dict())
    paths = str(folder / "conv_bn_relu.onnx"), str(folder / "conv_relu.onnx")
    _export(with_bn, paths[0], fold=False)
    _export(plain, paths[1], fold=True)
    return paths


def test_the_export_keeps_the_batch_norm(pair):
    ops = [n.op_type for n in onnx.load(pair[0]).graph.node]
    assert ops == ["Conv", "BatchNormalization", "Relu", "Conv"], ops
    assert [n.op_type for n in onnx.load(pair[1]).graph.node] == ["Conv", "Relu", "Conv"]


@pytest.mark.parametrize("level", ["v2", pytest.param("v3", marks=pytest.mark.slow)])
def test_conv_bn_relu_builds_to_the_kernels_of_conv_relu(pair, level):
    def kernels(path):
        r = compile_model(path, "cuda", "souffle", level=level, nvcc=False).report
        assert not r.fallback, r.fallback
        return [(k.primfunc, k.grid, k.block, k.flops, k.bytes, k.launches) for k in r.kernels]

    assert kernels(pair[0]) == kernels(pair[1])


@pytest.mark.parametrize("fusion", ["tvm", "souffle"])
def test_conv_bn_relu_matches_onnxruntime(pair, fusion):
    compiled = compile_model(pair[0], "llvm", fusion)
    assert fusion == "tvm" or compiled.report.fallback is None, compiled.report.fallback
    feeds = runner.random_inputs(compiled.model.inputs, 3)
    outs = runner.run_vm(compiled.executable, compiled.model.params, runner.check_feeds(compiled.model.inputs, feeds))
    _, ref = runner.reference_outputs(compiled.model.onnx_model, feeds)   # the file as exported, BN and all
    (c,) = runner.compare(compiled.model.outputs, outs, ref)
    assert c.finite and c.rel_l2 < 1e-5, c.rel_l2


def test_a_batch_norm_whose_conv_is_read_elsewhere_is_kept(pair):
    model = onnx.load(pair[0])
    conv_out = model.graph.node[0].output[0]
    model.graph.output.append(onnx.helper.make_tensor_value_info(conv_out, onnx.TensorProto.FLOAT, None))
    out, folded = onnx_bn.fold_batch_norms(model)
    assert folded == [] and out is model
    original = onnx.load(pair[0])
    out, folded = onnx_bn.fold_batch_norms(original)
    assert len(folded) == 1 and [n.op_type for n in out.graph.node] == ["Conv", "Relu", "Conv"]
    replaced = set(original.graph.node[1].input[1:]) | {original.graph.node[0].input[1]}   # BN's and the conv's
    assert len(replaced) == 5 and not {t.name for t in out.graph.initializer} & replaced
    assert np.isfinite(onnx.numpy_helper.to_array(out.graph.initializer[-1])).all()


# -- the exporter matrix's CNNs exported with their batch norms kept (tests/torch_models.py) ----
def _ops(model: onnx.ModelProto) -> list[str]:
    return sorted(n.op_type for n in model.graph.node)


def _folded(path: str, name: str) -> onnx.ModelProto:
    """The export as the importer hands it to TVM's: shapes folded, then its batch norms."""
    model = onnx.load(path)
    if onnx_fold.needs_folding(model):
        model = onnx_fold.fold(model, tm.input_shapes(name))
    return onnx_bn.fold_batch_norms(model)[0]


@pytest.mark.parametrize("name", tm.BN_MODELS)
@pytest.mark.parametrize("exporter", tm.BN_EXPORTERS)
def test_matrix_cnn_keeps_its_batch_norms_and_each_folds_into_its_conv(name, exporter):
    # legacy-bn: constant folding off, and the gammas/betas shared by value become Identity
    # aliases of one weight; dynamo-bn: onnxscript's optimizer off, and the bias-free convs get
    # a computed zero bias, Expand(CastLike(0, x), [C]). Folded, each is the graph the
    # exporter writes by default (batch norm folded into the convs).
    kept = onnx.load(tm.export(name, exporter))
    bns = sum(isinstance(m, nn.BatchNorm2d) for m in tm.build(name).modules())
    assert _ops(kept).count("BatchNormalization") == bns > 0
    default = exporter.removesuffix("-bn")
    assert _ops(_folded(tm.export(name, exporter), name)) == _ops(_folded(tm.export(name, default), name))


BN_MATRIX = [pytest.param(n, e, f, marks=() if (n, e, f) == ("resnext", "legacy-bn", "souffle") else pytest.mark.slow,
                          id=f"{n}-{e}-{f}") for n in tm.BN_MODELS for e in tm.BN_EXPORTERS for f in ("tvm", "souffle")]


@pytest.mark.parametrize("name,exporter,fusion", BN_MATRIX)
def test_matrix_cnn_with_batch_norms_matches_onnxruntime(name, exporter, fusion):
    compiled = compile_model(tm.export(name, exporter), "llvm", fusion, shapes=tm.input_shapes(name, 3))
    assert "BatchNormalization" in _ops(compiled.model.onnx_model)   # the reference runs the file as exported
    assert fusion == "tvm" or compiled.report.fallback is None, compiled.report.fallback
    feeds = tm.example_inputs(name, seed=1, batch=3)
    outs = runner.run_vm(compiled.executable, compiled.model.params, runner.check_feeds(compiled.model.inputs, feeds))
    _, ref = runner.reference_outputs(compiled.model.onnx_model, feeds)
    (c,) = runner.compare(compiled.model.outputs, outs, ref)
    assert c.finite and c.rel_l2 < 1e-5, c.rel_l2
