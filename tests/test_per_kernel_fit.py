"""Per-kernel times into the latency fit (issue 32, item 3): a kernel measured on a GPU is recorded
with the model's inputs of it, and ``souffle_experiments.latency_fit`` fits on it beside the totals. No GPU
here: the measured times below are planted, from known constants, on kernels the zoo's measured
builds really ran (data/latency), to show the fit finds those constants."""

import argparse
import dataclasses
import json
import statistics
from pathlib import Path

import pytest

from souffle_experiments import gpu_check, latency_fit
from souffle_tvm.cost import hardware, latency

ROOT = Path(__file__).resolve().parent.parent

H200 = hardware.for_arch("sm_90")
PLANTED = dataclasses.replace(latency.FITTED, warp_gbps=2.5, latency_us=1.2, kstep_cycles=900.0)


@pytest.fixture(scope="module")
def measured_kernels() -> list[latency.Kernel]:
    """The distinct kernels of the measured builds (one launch each), as the fit replays them."""
    points, _ = latency_fit.load_points()
    seen = {}
    for p in points:
        for k in p["kernels"]:
            seen.setdefault((k.name, k.grid, k.threads, k.stages), dataclasses.replace(k, launches=1))
    return list(seen.values())


def _planted(kernels, consts=PLANTED) -> list[dict]:
    return [{"key": f"k{i}", "form": "planted", "source": k.name, "kernel": k,
             "measured_us": latency.kernel_time(H200, consts, k).seconds * 1e6} for i, k in enumerate(kernels)]


def _median_error(consts, pts) -> float:
    return statistics.median(abs(latency_fit.predict_kernel_us(H200, consts, p) / p["measured_us"] - 1) for p in pts)


def test_per_kernel_times_find_the_constants_they_came_from(measured_kernels):
    """Kernel times planted from constants the totals' fit does not hold: the fitted model misses
    them, a fit on them finds the planted bandwidth per warp and prices them within 2%."""
    pts = _planted(measured_kernels)
    assert len(pts) >= 20
    assert _median_error(latency.FITTED, pts) > 0.15
    got = latency_fit.fit(H200, [], latency.FITTED, pts, starts=1)
    assert _median_error(got, pts) < 0.02
    assert got.warp_gbps == pytest.approx(PLANTED.warp_gbps, rel=0.1)


def test_kernel_points_move_a_joint_fit_and_weigh_as_much_as_the_totals(measured_kernels):
    """Beside the 78 measured totals, planted kernel times pull the fitted bandwidth per warp from
    the totals' value toward theirs: the kernels count. 481 kernels weigh as much as the totals,
    not six times as much: the fit stays a compromise (about 1.6 GB/s; one weight per point gives
    2.2), and the totals' error stays near the totals-only fit's 15%."""
    totals, _ = latency_fit.load_points()
    few, many = _planted(measured_kernels[:8]), _planted(measured_kernels)
    joint_few = latency_fit.fit(H200, totals, latency.FITTED, few, starts=1)
    joint_many = latency_fit.fit(H200, totals, latency.FITTED, many, starts=1)
    for got in (joint_few, joint_many):
        assert latency.FITTED.warp_gbps < got.warp_gbps < PLANTED.warp_gbps
        assert latency_fit.accuracy(H200, got, totals)["median_abs_error"] < 0.2
    assert len(many) > 6 * len(totals) and joint_many.warp_gbps < 2.0


def test_a_recorded_kernel_carries_what_the_model_prices_it_from(tmp_path):
    """``gpu_check record`` keeps each measured kernel's model inputs beside its time, and the fit
    reads them back as the same kernel; a time with no inputs is looked up in a committed
    predictions file by its key, and one found nowhere is left out and said."""
    row = {"name": "k0", "grid": [208], "block": [512], "registers": 40, "shared_bytes": 8192, "launches": 22,
           "bytes": 3_350_000, "flops": 2 * 196 * 512 * 1024, "elem_bytes": 4, "form": "StitchedMatmul@512",
           "block_counts": {"threads": 512, "shared_wavefronts": 16384, "k_steps": 64, "pipelined_steps": 0,
                            "barriers": 128}, "stages": None}
    inputs = latency.row_inputs(row)
    assert "stages" not in inputs and "form" not in inputs and inputs["block_counts"]["k_steps"] == 64
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    kernels = [{"name": "k0", "key": "sm_90|aa|208|512", "form": row["form"], "inputs": inputs, "predicted_us": 1.0},
               {"name": "k1", "key": "sm_90|bb|1|32", "form": "Fallback@256"},
               {"name": "k2", "key": "sm_90|cc|1|32", "form": "Fallback@256"}]
    (bundle / "manifest.json").write_text(json.dumps({"cases": [{"id": "c", "report": {"kernels": kernels}}]}))
    result = tmp_path / "gpu_check.json"
    result.write_text(json.dumps({"gpu": "H200", "date": "x", "cases": [
        {"id": "c", "kernel_ms": {"k0": 0.44, "k1": 0.01, "k2": 0.02}, "kernel_names": {"k0": 22, "k1": 1, "k2": 1}}]}))
    db = tmp_path / "measured.json"
    gpu_check.record(argparse.Namespace(bundle=str(bundle), result=str(result), db=str(db)))
    entry = json.loads(db.read_text())["kernels"]["sm_90|aa|208|512"]
    assert entry["us"] == 20.0 and entry["inputs"] == inputs and entry["form"] == row["form"]

    root = tmp_path / "data"
    (root / "latency").mkdir(parents=True)
    k1 = {"name": "k1", "key": "sm_90|bb|1|32", "form": "Fallback@256",
          "inputs": {"name": "k1", "grid": [1], "block": [32], "launches": 1, "bytes": 4096, "flops": 0}}
    (root / "latency" / "microbench-predictions-x.json").write_text(json.dumps({"cases": [{"kernels": [k1]}]}))
    pts, skipped = latency_fit.load_kernel_points(db, root)
    assert sorted(p["key"] for p in pts) == ["sm_90|aa|208|512", "sm_90|bb|1|32"]
    assert len(skipped) == 1 and "sm_90|cc|1|32" in skipped[0]
    (k,) = latency.kernels_from_rows([row])
    got = next(p for p in pts if p["key"] == "sm_90|aa|208|512")
    assert got["measured_us"] == 20.0 and got["form"] == row["form"]
    assert latency_fit.predict_kernel_us(H200, latency.FITTED, got) == pytest.approx(
        latency.kernel_time(H200, latency.FITTED, k).seconds * 1e6)
