"""--fusion souffle (V2: transforms + one kernel per anchor group): numerics and launch counts."""

import pytest

from conftest import ZOO, run_and_compare
from souffle_tvm.api import compile as compile_model


@pytest.mark.parametrize("name", ZOO)
def test_small_model_souffle_cpu_twin_matches(name):
    c = compile_model(name, "llvm", "souffle", small=True)
    assert c.report.fusion == "souffle" and c.report.fallback is None
    for cmp in run_and_compare(c):
        assert cmp.finite and cmp.rel_l2 < 1e-5, (name, cmp)


V2_NOT_FEWER = pytest.mark.xfail(strict=True, reason=(
    "EfficientNet: V2 (one kernel per anchor group, no stitching) launches 31 kernels, TVM 28, once "
    "reshape views are not counted as launches (a GPU trace showed they launch nothing); V3 is 1"))


@pytest.mark.parametrize("name", [n if n != "efficientnet" else pytest.param(n, marks=V2_NOT_FEWER) for n in ZOO])
def test_small_model_souffle_has_fewer_launches_than_tvm(name):
    tvm_r = compile_model(name, "cuda", "tvm", small=True, nvcc=False).report
    sou_r = compile_model(name, "cuda", "souffle", small=True, nvcc=False).report
    assert sou_r.launches < tvm_r.launches, (sou_r.launches, tvm_r.launches)
    assert len(sou_r.groups) >= 1 and all(g["reason"] for g in sou_r.groups)


def test_bert_layer_at_most_ten_launches():
    r = compile_model("bert", "cuda", "souffle", small=True, nvcc=False).report
    assert r.launches <= 10 * 2           # the small BERT has 2 layers


@pytest.mark.parametrize("level", ["v0", "v1", "v2"])
def test_ablation_levels_build_and_match(level):
    c = compile_model("bert", "llvm", "souffle", small=True, level=level)
    assert c.report.level == level
    for cmp in run_and_compare(c):
        assert cmp.rel_l2 < 1e-5


def test_v2_has_the_fewest_launches():
    # Horizontal alone (v1) can add launches: the merged GEMM's outputs are read through
    # slice stages that only the vertical transform composes away.
    v0, v1, v2 = (compile_model("bert", "cuda", "souffle", small=True, level=lv, nvcc=False).report.launches
                  for lv in ("v0", "v1", "v2"))
    assert v2 < v0 and v2 <= v1
