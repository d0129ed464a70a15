"""Full-size zoo models compile for CUDA with TVM's fusion (slow: `make test-all`)."""

import pytest

from conftest import ZOO
from souffle_tvm import zoo
from souffle_tvm.pipeline.driver import compile as compile_model


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


# The partitioner issue's targets at full size: launches of `--fusion souffle --level v3`.
SOUFFLE_TARGETS = {"lstm": ("==", 1), "mmoe": ("==", 1), "bert": ("<=", 12),
                   "resnext": ("10x", None), "efficientnet": ("10x", None), "swin": ("10x", None)}


@pytest.mark.slow
@pytest.mark.parametrize("name", ZOO)
def test_full_model_souffle_meets_its_launch_target(name):
    dtype = zoo.MODELS[name].paper_dtype
    r = compile_model(name, "cuda", "souffle", level="v3", dtype=dtype).report
    kind, value = SOUFFLE_TARGETS[name]
    if kind == "==":
        assert r.launches == value, r.subprograms
    elif kind == "<=":
        assert r.launches <= value, r.subprograms
    else:
        tvm_launches = compile_model(name, "cuda", "tvm", dtype=dtype, nvcc=False).report.launches
        assert r.launches * 10 <= tvm_launches, (r.launches, tvm_launches)
    assert all(sp["reason"] for sp in r.subprograms)
    if r.nvcc["available"]:
        assert all(k.spill_bytes == 0 for k in r.kernels if k.cooperative and name != "bert"), \
            "only BERT-base fp16's layer kernel is known to spill (docs/partitioner.md)"
