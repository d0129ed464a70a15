"""The latency model against what a GPU measured (data/gpu, replayed by souffle_experiments.latency_fit):
the bounds issue 32 sets, checked so that they can fail."""

import dataclasses
import json
import statistics
from pathlib import Path

import pytest

from souffle_experiments import latency_fit
from souffle_tvm.cost import hardware, latency

ROOT = Path(__file__).resolve().parent.parent

H200 = hardware.for_arch("sm_90")


@pytest.fixture(scope="module")
def points():
    pts, _skipped = latency_fit.load_points()
    assert len(pts) == 78
    return pts


def test_the_fitted_model_is_within_the_median_bound(points):
    got = latency_fit.accuracy(H200, latency.FITTED, points)
    assert got["median_abs_error"] <= latency_fit.MEDIAN_BOUND, got
    assert got["pairs"] == 38


def test_the_fitted_model_orders_souffle_and_tvm_as_measured(points):
    got = latency_fit.accuracy(H200, latency.FITTED, points)
    assert got["signs_right"] >= latency_fit.SIGNS_BOUND and got["within"], got


def test_the_sector_term_carries_the_order_bound(points):
    """The fourth form's constants order 31 of 38 pairs; the same constants with uncoalesced sectors
    priced as L2 traffic, not refitted, order 35 (BERT full's stitched attention of 2026-11-29, a
    lane per row of the fused QKV buffer, stops looking as fast as TVM's kernels)."""
    without = latency_fit.accuracy(H200, latency.BEFORE, points)
    with_term = latency_fit.accuracy(H200, dataclasses.replace(latency.BEFORE, l1_miss=1.0), points)
    assert without["signs_right"] < latency_fit.SIGNS_BOUND <= with_term["signs_right"], (without, with_term)


@pytest.mark.parametrize("name,factor", [("warp_gbps", 0.5), ("warp_gbps", 2.0), ("latency_us", 3.0),
                                         ("latency_us", 4.0)])
def test_perturbed_constants_break_the_bounds(points, name, factor):
    """The bounds the fit meets are not vacuous: a fitted constant moved by a plausible factor
    fails them (warp_gbps halved: 32% median error; doubled: 33 of 38 pairs in order). Not every
    factor does: latency_us doubled keeps both (23%, 35 of 38: the totals cannot tell it from the
    fit), tripled fails by a hair (25.1% against 25%), four times clearly (39%, 32 of 38)."""
    bad = dataclasses.replace(latency.FITTED, **{name: getattr(latency.FITTED, name) * factor})
    got = latency_fit.accuracy(H200, bad, points)
    assert not got["within"], got


def test_a_dearer_grid_sync_orders_fewer_pairs_right(points):
    """The order count responds to the constants: a grid sync priced 4x the fit gets 28 of 38."""
    fitted = latency_fit.accuracy(H200, latency.FITTED, points)
    bad = latency_fit.accuracy(H200, dataclasses.replace(latency.FITTED, sync_us=4 * latency.FITTED.sync_us), points)
    assert bad["signs_right"] < fitted["signs_right"], (bad, fitted)


def _lomo_median(points, lomo: dict) -> float:
    """Median |error| of each point priced with the constants fitted without its model."""
    return statistics.median(abs(latency_fit.error(latency_fit.predict_ms(
        H200, dataclasses.replace(latency.FITTED, **lomo[p["model"]]), p), p["measured_ms"])) for p in points)


def test_leave_one_model_out_median_from_the_cached_refits(points):
    """The leave-one-model-out bound in the default suite, from the refits the last fit kept
    (data/latency/fit.json ``lomo_constants``; refitting takes 4 minutes, the slow test below):
    each model's points priced by today's model with the constants fitted without that model.
    The cache is the one the fitted constants came from, and it is no vacuous bound: every
    held-out set with latency_us four times its value fails it."""
    fit = json.loads((ROOT / "data" / "latency" / "fit.json").read_text())
    assert fit["constants"] == pytest.approx(latency.FITTED.as_dict(), rel=1e-3)
    lomo = fit["lomo_constants"]
    assert set(lomo) == {p["model"] for p in points}
    median = _lomo_median(points, lomo)
    assert median <= latency_fit.MEDIAN_BOUND, median
    assert median == pytest.approx(fit["lomo_median_abs_error"], abs=0.02)     # today's model, same answer
    worse = {m: {**c, "latency_us": 4 * c["latency_us"]} for m, c in lomo.items()}
    assert _lomo_median(points, worse) > latency_fit.MEDIAN_BOUND


@pytest.mark.slow
def test_leave_one_model_out_median_is_within_the_bound(points):
    """Refit without each model and predict it (4 minutes on 2 cores)."""
    v = latency_fit.validate(H200, points)
    assert v["lomo_median_abs_error"] <= latency_fit.MEDIAN_BOUND, v["lomo_median_abs_error"]
