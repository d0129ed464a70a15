"""Every small zoo model imports, builds for llvm and matches onnxruntime."""

import pytest

from conftest import ZOO, run_and_compare


@pytest.mark.parametrize("name", ZOO)
def test_small_model_matches_onnxruntime_fp32(llvm_builds, name):
    for c in run_and_compare(llvm_builds(name)):
        assert c.finite, f"{name}:{c.name} has non-finite values"
        assert c.rel_l2 < 1e-5, f"{name}:{c.name} rel L2 {c.rel_l2:.2e}"


@pytest.mark.parametrize("name", ["bert", "swin"])
def test_small_model_matches_onnxruntime_fp16(llvm_builds, name):
    compiled = llvm_builds(name, "float16")
    assert compiled.model.inputs[0].dtype == "float16"
    for c in run_and_compare(compiled, seed=3):
        assert c.finite and c.rel_l2 < 1e-2, f"{name}:{c.name} rel L2 {c.rel_l2:.2e}"
