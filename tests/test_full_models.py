"""Full-size zoo models compile for CUDA with TVM's fusion (slow: `make test-all`)."""

import pytest

from conftest import ZOO
from souffle_tvm import zoo
from souffle_tvm.api import compile as compile_model


@pytest.mark.slow
@pytest.mark.parametrize("name", ZOO)
def test_full_model_cuda_report(name):
    c = compile_model(name, "cuda", "tvm", dtype=zoo.MODELS[name].paper_dtype)
    r = c.report
    assert r.launches > r.distinct_kernels > 0
    assert r.flops > 0 and r.bytes > 0
    if r.nvcc["available"]:
        assert all(k.registers for k in r.kernels)


@pytest.mark.slow
def test_full_lstm_compiles_in_minutes():
    r = compile_model("lstm", "cuda", "tvm").report
    assert r.compile_seconds < 300
    assert r.distinct_kernels < 20      # steps share kernels instead of one kernel per step
