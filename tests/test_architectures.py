"""Today's architectures as a regression net (issue 58, item 3): decoder-only transformers with
causal masks and rotary embeddings (Llama, GPT-2), T5's relative position bias, a speech
encoder with a convolutional front-end (wav2vec2), ConvNeXt, MobileNetV2, RegNetY, DeiT, a
bidirectional-GRU speech model, an LSTM language model and a top-k mixture of experts, each
exported from PyTorch (``hf_models``), must match onnxruntime on llvm at the default level and
build for CUDA with nvcc at the default level and at v3, in float32 and in float16."""

import numpy as np
import pytest

import hf_models as hf
from souffle_tvm.pipeline.driver import compile as compile_model
from souffle_tvm.runtime import runner

NAMES = list(hf.ARCHS)


@pytest.mark.parametrize("name", NAMES)
def test_matches_onnxruntime_on_llvm(name):
    compiled = compile_model(hf.export(name), "llvm", "souffle")
    feeds = hf.example_input(name)
    outs = runner.run_vm(compiled.executable, compiled.model.params, [feeds[i.name] for i in compiled.model.inputs])
    _, ref = runner.reference_outputs(compiled.model.onnx_model, feeds)
    for c in runner.compare(compiled.model.outputs, outs, ref):
        assert c.ok(1e-4), (name, c.name, c.rel_l2)
    assert all(np.isfinite(o).all() for o in outs)


# In the default suite: the default level in float32 and v3 (where stitching regresses) in
# float16; the two other combinations (17 s a build on this machine) in `make test-all`.
FORMS = [("auto", "float32"), ("v3", "float16"), pytest.param("auto", "float16", marks=pytest.mark.slow),
         pytest.param("v3", "float32", marks=pytest.mark.slow)]


@pytest.mark.parametrize("level,dtype", FORMS)
@pytest.mark.parametrize("name", NAMES)
def test_builds_for_cuda(name, level, dtype):
    report = compile_model(hf.export(name), "cuda", "souffle", level=level, dtype=dtype).report
    assert report.nvcc.get("available") and report.launches > 0
    if level == "v3":       # Souffle's own pipeline built it (no fallback to TVM's path)
        assert report.fallback is None and report.level == "v3", report.fallback
    assert all(k.elem_bytes == 2 for k in report.kernels if k.tensor_core)
