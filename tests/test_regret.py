"""Choosing without a device (issue 57, item 5): where the leave-one-model-out constant sets
disagree on which build is faster, the build of least worst-case regret is kept and the report
says the choice is uncertain and where it flips."""

import json
from pathlib import Path

import pytest

from souffle_tvm.cost import latency, shipped
from souffle_tvm.measure import regret
from souffle_tvm.pipeline.driver import compile as compile_model

SETS = shipped.leave_one_model_out()


def _sync_bound(c):
    """A stitched build that pays 100 grid syncs against a fixed 150 us for separate kernels."""
    return {"stitched": 100e-6 * c.sync_us, "separate": 150e-6}


def test_a_choice_that_flips_inside_the_sets_minimises_the_worst_regret():
    syncs = sorted(c.sync_us for c in SETS.values())
    assert syncs[0] < 1.5 < latency.FITTED.sync_us <= syncs[-1]     # the sets straddle the flip at 1.5 us
    choice = regret.choose(_sync_bound, latency.FITTED, SETS)
    assert choice.fitted == "separate"            # 171 us against 150 us under the fitted constants
    assert choice.uncertain
    worst = {n: max(_sync_bound(c)[n] - min(_sync_bound(c).values()) for c in [latency.FITTED, *SETS.values()])
             for n in ("stitched", "separate")}
    assert choice.regret == pytest.approx(worst)
    assert choice.name == min(worst, key=worst.get)
    (flip,) = [f for f in choice.flips if f.startswith("sync_us")]
    assert flip.startswith("sync_us 1.5"), flip
    assert all(not f.startswith("node_us") for f in choice.flips)       # that constant moves nothing here


def test_a_choice_every_set_agrees_on_is_certain():
    choice = regret.choose(lambda c: {"a": 1e-6 * c.sync_us, "b": 1.0}, latency.FITTED, SETS)
    assert choice.name == choice.fitted == "a" and not choice.uncertain and choice.flips == []
    assert choice.regret["a"] == 0.0


def test_the_auto_choice_on_cuda_is_made_over_the_sets_and_reported():
    compiled = compile_model("mmoe", "cuda", "souffle", small=True)
    lat = compiled.report.latency
    choice = lat["choice"]
    assert set(choice["worst_regret_ms"]) == {"souffle", "tvm"}
    kept = "tvm" if compiled.report.fallback else "souffle"
    assert choice["chosen"] == kept
    assert choice["worst_regret_ms"][kept] == min(choice["worst_regret_ms"].values())
    # the regret is computed from the same predictions the report gives
    ours = lat.get("graph_ms") if kept == "souffle" else lat.get("souffle_graph_ms")
    assert ours is not None


def test_the_shipped_constants_are_the_committed_fit():
    """Package data (what an installed wheel reads) equals the fit in data/latency/fit.json."""
    fit = json.loads((Path(__file__).resolve().parent.parent / "data" / "latency" / "fit.json").read_text())
    assert shipped.fitted().as_dict() == pytest.approx(fit["constants"])
    assert set(SETS) == set(fit["lomo_constants"])
    for m, c in SETS.items():
        assert c.as_dict() == pytest.approx(fit["lomo_constants"][m])
    for n in latency.NAMES:
        assert getattr(shipped.fitted(), n) == pytest.approx(getattr(latency.FITTED, n), rel=1e-3)
