"""The per-kernel microbenchmark bundle (souffle_experiments.microbench, issue 32 item 3), built here without
a GPU: the smallest cases build, their forms are the ones the rules give, the predictions file
has the schema the run is compared against, and the manifest is what gpu_check's device side reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import require_nvcc
from souffle_experiments import microbench as mb

ROOT = Path(__file__).resolve().parent.parent

KERNEL_FIELDS = ("name", "key", "form", "grid", "block", "predicted_us", "floor_us", "floor_by")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    require_nvcc()          # the cubins need it; nvcc is part of the set-up (conftest)
    out = tmp_path_factory.mktemp("mb") / "microbench_bundle"
    pred = out.parent / "predictions.json"
    saved = mb.SYNC_COUNTS, mb.SYNC_BLOCKS_PER_SM
    mb.SYNC_COUNTS, mb.SYNC_BLOCKS_PER_SM = (1, 16), (1, 4)      # fewer probes than the bundle's: time
    try:
        rc = mb.main(["prepare", "--out", str(out), "--families", "softmax", "elementwise", "--sizes", "s",
                      "--fusions", "souffle", "tvm", "--no-wheel", "--predictions", str(pred)])
    finally:
        mb.SYNC_COUNTS, mb.SYNC_BLOCKS_PER_SM = saved
    assert rc == 0
    return out, json.loads((out / "manifest.json").read_text()), json.loads(pred.read_text())


def test_cases_cover_every_rule_form_and_three_sizes():
    cs = mb.cases()
    assert len({c.id for c in cs}) == len(cs)
    for op in mb.FAMILIES:
        assert {c.size for c in cs if c.op == op} == set(mb.SIZES)
        assert {c.fusion for c in cs if c.op == op} == {"souffle", "tvm"}
    aims = " ".join(c.aim for c in cs)
    for rule in mb.RULE_FORMS:
        assert rule in aims or rule == "AtomicRows" and any(c.options.get("reduction") == "atomic" for c in cs)


def test_predictions_schema_and_forms(built):
    _, manifest, pred = built
    assert pred["date"] == mb.DATE and pred["arch"] == mb.ARCH
    by_id = {c["id"]: c for c in pred["cases"]}
    assert set(by_id) == {"mb-softmax-s-souffle", "mb-softmax-s-tvm", "mb-elementwise-s-souffle",
                          "mb-elementwise-s-tvm"}
    for c in pred["cases"]:
        assert c["predicted_ms"] > 0 and c["kernels"]
        for k in c["kernels"]:
            assert set(KERNEL_FIELDS) <= set(k)
            # keyed where the partitioner looks times up (souffle's kernels); TVM's fused PrimFuncs
            # are not in the imported module gpu_check keys from, so theirs go by form and name only
            assert (k["key"] or "").startswith(f"{mb.ARCH}|") if c["fusion"] == "souffle" else k["key"] is None
            assert k["predicted_us"] > 0 and k["floor_us"] is not None and k["predicted_us"] >= k["floor_us"]
    # the forms are read from the builds
    assert [k["form"] for k in by_id["mb-softmax-s-souffle"]["kernels"]] == ["RowReduction@256"]
    assert [k["form"] for k in by_id["mb-elementwise-s-souffle"]["kernels"]] == ["Fallback@256"]
    assert all(k["form"].startswith("dlight") for k in by_id["mb-softmax-s-tvm"]["kernels"])
    assert pred["forms"]["rules"]["RowReduction"] == ["RowReduction@256"]
    assert "StitchedMatmul" in pred["forms"]["missing"]      # not built in this subset
    probes = pred["timing_probes"]
    assert {p["blocks_per_sm"] for p in probes if p["syncs"]} == {1, 4}
    assert [p["name"] for p in probes if not p["syncs"]] == ["empty"]
    assert all(p["grid"] == pred["sms"] * p["blocks_per_sm"] for p in probes if p["syncs"])
    assert all(p["predicted_blocks_per_sm_fit"] for p in probes if p["syncs"])
    est = pred["gpu_time_estimate"]
    assert 0 < est["total_s"] <= est["budget_s"] == 300
    assert 0 < pred["bundle"]["tree_bytes"] and \
        pred["bundle"]["tgz_bytes"] + pred["bundle"]["tree_bytes"] <= mb.CARRY_LIMIT


def test_manifest_is_what_gpu_check_runs(built):
    out, manifest, _ = built
    assert manifest["arch"] == mb.ARCH and manifest["probes"] == []
    for case in manifest["cases"]:
        # the fields gpu_check.run/_run_case/_params/record read
        for f in ("id", "model", "size", "fusion", "variant", "dtype", "lib", "params", "inputs", "outputs",
                  "report", "io_npz"):
            assert f in case, f
        assert (out / case["lib"]).is_file() and (out / case["io_npz"]).is_file()
        assert all(p["src"] == "npz" for p in case["params"])     # nothing regenerated from the zoo there
        if case["params"]:
            import numpy as np

            npz = np.load(out / case["params_npz"])
            assert all(list(npz[p["key"]].shape) == p["shape"] for p in case["params"])
        io = __import__("numpy").load(out / case["io_npz"])
        assert {f"in_{i['name']}" for i in case["inputs"]} | {f"ref_{i}" for i in range(len(case["outputs"]))} \
            == set(io.files)
        rep = case["report"]
        assert rep["launches"] >= 1 and rep["predicted"]["ms"] > 0
        for k in rep["kernels"]:
            assert k["cubin"] and (out / "cubins" / k["cubin"]).is_file()
            assert bool(k["key"]) == (case["fusion"] == "souffle")
    for p in manifest["timing_probes"]:
        assert (out / p["lib"]).is_file() and (out / "cubins" / p["cubin"]).is_file()
        assert p["cooperative"] == (p["syncs"] > 0)
    for lib in mb.gpu_check.standalone.RUNTIME_LIBS:
        assert (out / "runtime" / lib).is_file()
    assert (out.parent / "microbench_bundle.tgz").is_file()


def test_record_takes_the_traced_times(built, tmp_path):
    """gpu_check.record on a result shaped like run's (kernel_ms summed over --trace-reps
    inferences) writes each keyed kernel's mean time per launch under its key."""
    import argparse

    out, manifest, _ = built
    case = next(c for c in manifest["cases"] if c["fusion"] == "souffle")
    k = case["report"]["kernels"][0]
    result = {"gpu": "NVIDIA H200", "date": "2026-12-03", "cases": [
        {"id": case["id"], "kernel_ms": {k["name"]: 0.05}, "kernel_names": {k["name"]: 20}, "trace_reps": 20}]}
    (tmp_path / "gpu_check.json").write_text(json.dumps(result))
    db = tmp_path / "measured.json"
    mb.gpu_check.record(argparse.Namespace(bundle=str(out), result=str(tmp_path / "gpu_check.json"), db=str(db)))
    entries = json.loads(db.read_text())["kernels"]
    assert entries[k["key"]]["us"] == pytest.approx(2.5)


def test_probe_fit():
    rows = [{"syncs": n, "blocks_per_sm": b, "batch_us": 3.0 + 1.5 * b * n} for b in (1, 2) for n in (1, 16, 64)]
    rows.append({"syncs": 0, "batch_us": 2.0, "graph1_us": 3.0, "graph100_us": 3.0 + 99 * 0.6})
    fit = mb.fit_probes(rows)
    assert fit["sync_us"]["1"]["per_sync"] == pytest.approx(1.5)
    assert fit["sync_us"]["2"]["per_sync"] == pytest.approx(3.0)
    assert fit["launch_us"] == 2.0 and fit["node_us"] == pytest.approx(0.6)


def test_the_committed_bundle_travels_in_one_device_call():
    """The predictions committed for the next GPU say the bundle they were made with fits one
    device call beside the working tree (the .tgz alone fitting is not enough)."""
    bundle = json.loads(mb.PREDICTIONS.read_text())["bundle"]
    assert bundle["tree_bytes"] > 0
    assert bundle["tgz_bytes"] + bundle["tree_bytes"] <= mb.CARRY_LIMIT, bundle
