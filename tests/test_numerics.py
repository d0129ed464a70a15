"""Every small zoo model imports, builds for llvm and matches onnxruntime; fp16 also through Souffle (v2, v3 emulated)."""

import pytest

from conftest import ZOO, emulated_comparisons, run_and_compare
from souffle_tvm.pipeline.driver import compile as compile_model


@pytest.mark.parametrize("name", ZOO)
def test_small_model_matches_onnxruntime_fp32(llvm_builds, name):
    for c in run_and_compare(llvm_builds(name)):
        assert c.finite, f"{name}:{c.name} has non-finite values"
        assert c.rel_l2 < 1e-5, f"{name}:{c.name} rel L2 {c.rel_l2:.2e}"


@pytest.mark.parametrize("name", ["bert", pytest.param("swin", marks=pytest.mark.slow)])   # swin: 19 s
def test_small_model_matches_onnxruntime_fp16(llvm_builds, name):
    compiled = llvm_builds(name, "float16")
    assert compiled.model.inputs[0].dtype == "float16"
    for c in run_and_compare(compiled, seed=3):     # measured rel. L2: bert 2.26e-3, swin 2.39e-3
        assert c.finite and c.rel_l2 < 5e-3, f"{name}:{c.name} rel L2 {c.rel_l2:.2e}"


# fp16 through the Souffle pipeline (issue 20, part 4). Measured rel. L2 (seed 3): bert 2.256e-3
# at v2, 2.268e-3 at v3, swin 2.389e-3 at both (v2 on llvm, v3's CUDA kernels emulated); the
# bound, 5e-3, is about twice that. Except bert at v3, the same figures as --fusion tvm's (every
# GEMM here is below the tensor-core rule's size, so no wmma).
FP16_SOUFFLE = [("bert", "v2"), ("bert", "v3"), pytest.param("swin", "v2", marks=pytest.mark.slow),
                pytest.param("swin", "v3", marks=pytest.mark.slow)]     # swin 31 s, 26-40 s: bert's by default


@pytest.mark.parametrize("name,level", FP16_SOUFFLE)
def test_small_model_souffle_fp16_matches_onnxruntime(name, level):
    """v2 built for llvm and run; v3 built for CUDA (stitched cooperative kernels) and its kernels
    run in the GPU emulator (runtime.emulate)."""
    target = "llvm" if level == "v2" else "cuda"
    c = compile_model(name, target, "souffle", small=True, dtype="float16", level=level, nvcc=False)
    assert c.report.fusion == "souffle" and c.report.fallback is None, c.report.fallback
    assert c.model.inputs[0].dtype == "float16"
    if level == "v3":
        assert any(k.cooperative and k.grid_syncs for k in c.report.kernels), "nothing stitched"
        cmps = emulated_comparisons(c.model, c.model.mod, c.model.params, seed=3)
    else:
        cmps = run_and_compare(c, seed=3)
    for cmp in cmps:
        assert cmp.finite and cmp.rel_l2 < 5e-3, f"{name} {level}:{cmp.name} rel L2 {cmp.rel_l2:.2e}"


@pytest.mark.slow      # ~40 s (compile 14 s, emulation 24 s)
def test_fp16_bert_layer_on_tensor_cores_stitched_and_emulated():
    """The small zoo models' GEMMs are too small for tensor cores (every extent must exceed 64):
    a BERT layer at seq 128, hidden 128, ffn 256 stitches its linear layers on wmma, and the
    emulated kernel matches onnxruntime (measured rel. L2 1.98e-3, fp16 accumulation)."""
    from souffle_tvm.zoo import bert

    model = bert.build(bert.BertConfig(layers=1, seq=128, hidden=128, heads=2, ffn=256), dtype="float16")
    c = compile_model(model, "cuda", "souffle", level="v3", nvcc=False)
    assert c.report.fallback is None, c.report.fallback
    (k,) = c.report.kernels
    assert k.cooperative and k.tensor_core and "wmma::mma_sync" in c.cuda_source
    for cmp in emulated_comparisons(c.model, c.model.mod, c.model.params, seed=3):
        assert cmp.finite and cmp.rel_l2 < 4e-3, cmp
