"""Measuring where a device can be reached (issue 57), for real on this CPU: ``--level auto
--measure`` times its candidate builds here, checks each against onnxruntime, keeps the
measured fastest, and keeps every time in a timing cache per device.

Planted faults each test fails against: a slower candidate the model predicts fastest (a
choice by prediction keeps it), a faster candidate with wrong outputs (a choice without the
numeric check keeps it), a second compile (one that re-times anything hits the guard), a
compile killed while writing the cache (a partial entry would be read).
"""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from souffle_tvm import zoo
from souffle_tvm.cost.timing_cache import TimingCache, device_id
from souffle_tvm.errors import MeasureError, OptionsError
from souffle_tvm.measure import timing, trials
from souffle_tvm.measure.device import reach
from souffle_tvm.pipeline import measuring
from souffle_tvm.pipeline.driver import compile as compile_model

from rpc_farm import KEY, rpc_farm


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SOUFFLE_TVM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _kept_is_justified(measured: dict) -> None:
    """The kept build matched, and no matching candidate beat it by more than the noise."""
    rows = {c["name"]: c for c in measured["candidates"]}
    kept = rows[measured["chosen"]]
    assert kept["matched"] is True and kept["ms"] > 0
    for c in rows.values():
        if c["matched"] and c["ms"] is not None:
            assert kept["ms"] <= c["ms"] + max(kept["spread_ms"], c["spread_ms"]) + 1e-12, (kept, c)


def test_measure_on_this_cpu_keeps_the_measured_fastest_and_caches_every_time(cache, monkeypatch):
    compiled = compile_model("mmoe", "llvm", "souffle", small=True, measure=True)
    m = compiled.report.measured
    assert m is not None and m["reference"] == "onnxruntime"
    names = [c["name"] for c in m["candidates"]]
    assert names == ["souffle", "tvm", "souffle v3 budget"]
    for c in m["candidates"]:
        assert c["matched"] is True and c["ms"] > 0 and c["runs"] == timing.REPEAT and not c["cached"], c
    _kept_is_justified(m)
    # every kernel of the kept build was timed on this device
    rows = compiled.report.kernels
    assert rows and all(k.timed == "here" and k.measured_us > 0 for k in rows), [(k.name, k.timed) for k in rows]
    saved = json.loads((cache / "timing" / f"{device_id(m['device'])}.json").read_text())
    assert len(saved["candidates"]) >= 2 and len(saved["kernels"]) >= len(rows)
    assert "measured on" in compiled.report.table() and "kernels of the kept build" in compiled.report.table()

    # the second compile on this device times nothing: every figure comes from the cache
    def no_timing(*args, **kwargs):
        raise AssertionError("timed again")
    monkeypatch.setattr(timing, "inference", no_timing)
    monkeypatch.setattr(timing, "kernels", no_timing)
    again = compile_model("mmoe", "llvm", "souffle", small=True, measure=True)
    m2 = again.report.measured
    assert all(c["cached"] or c["note"] == "the same build as souffle" for c in m2["candidates"])
    assert m2["chosen"] == m["chosen"]
    assert [c["ms"] for c in m2["candidates"]] == [c["ms"] for c in m["candidates"]]


def _with_dead_weight(model: onnx.ModelProto, matmuls: int = 8, n: int = 256) -> onnx.ModelProto:
    """``model`` plus a chain of n x n MatMuls whose mean, times zero, is added to each output:
    the same outputs, much more work."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    rng = np.random.default_rng(3)
    g.initializer.append(numpy_helper.from_array((rng.standard_normal((n, n)) / np.sqrt(n)).astype(np.float32), "dw_w"))
    g.initializer.append(numpy_helper.from_array(np.ones((n, n), np.float32), "dw_x"))
    g.initializer.append(numpy_helper.from_array(np.zeros((), np.float32), "dw_zero"))
    prev = "dw_x"
    for i in range(matmuls):
        g.node.append(helper.make_node("MatMul", [prev, "dw_w"], [f"dw_{i}"]))
        prev = f"dw_{i}"
    g.node.append(helper.make_node("ReduceMean", [prev], ["dw_mean"], keepdims=0))
    g.node.append(helper.make_node("Mul", ["dw_mean", "dw_zero"], ["dw_nothing"]))
    for out in g.output:
        inner = out.name + "_inner"
        for node in g.node:
            node.output[:] = [inner if o == out.name else o for o in node.output]
            node.input[:] = [inner if i == out.name else i for i in node.input]
        g.node.append(helper.make_node("Add", [inner, "dw_nothing"], [out.name]))
    onnx.checker.check_model(m)
    return m


def test_a_planted_slower_candidate_is_never_kept_even_when_predicted_fastest(cache):
    souffle = compile_model("mmoe", "llvm", "souffle", small=True, measure=False)
    tvm_build = compile_model("mmoe", "llvm", "tvm", small=True)
    slow = compile_model(_with_dead_weight(zoo.build("mmoe", small=True)), "llvm", "tvm")
    device = reach(souffle.target, measure=True)
    original = measuring.candidate

    def planted(name, compiled):       # the model would pick the slow one: it is predicted fastest
        cand = original(name, compiled)
        cand.predicted_ms = 1e-6 if name == "planted slow" else 1.0
        return cand
    measuring.candidate = planted
    try:
        chosen = measuring.choose(device, [("souffle", souffle), ("tvm", tvm_build), ("planted slow", slow)])
    finally:
        measuring.candidate = original
    m = chosen.report.measured
    rows = {c["name"]: c for c in m["candidates"]}
    assert rows["planted slow"]["matched"] is True        # right answers, only slower
    assert rows["planted slow"]["predicted_ms"] == 1e-6
    assert m["chosen"] != "planted slow"
    assert rows["planted slow"]["ms"] > 5 * max(rows["souffle"]["ms"], rows["tvm"]["ms"])
    _kept_is_justified(m)


def test_a_planted_wrong_answer_candidate_is_never_kept(cache):
    souffle = compile_model("mmoe", "llvm", "souffle", small=True, measure=False)
    tvm_build = compile_model("mmoe", "llvm", "tvm", small=True)
    wrong = compile_model("mmoe", "llvm", "souffle", small=True, measure=False)
    wrong.model.params = [p * 1.5 if p.dtype.kind == "f" else p for p in wrong.model.params]   # same speed, wrong outputs
    device = reach(souffle.target, measure=True)
    chosen = measuring.choose(device, [("tvm", tvm_build), ("planted wrong", wrong)])
    rows = {c["name"]: c for c in chosen.report.measured["candidates"]}
    assert rows["planted wrong"]["ms"] > 0 and rows["planted wrong"]["matched"] is False
    assert "do not match the reference" in rows["planted wrong"]["note"]
    assert chosen.report.measured["chosen"] == "tvm"
    assert chosen is tvm_build
    # alone, it is no choice at all: a clear error, not a wrong answer
    with pytest.raises(Exception, match="no candidate ran and matched the reference"):
        measuring.choose(device, [("planted wrong", wrong)])


def test_pick_needs_more_than_the_noise_to_leave_the_baseline():
    base = trials.Trial("tvm", ms=1.00, spread_ms=0.05, matched=True)
    close = trials.Trial("souffle", ms=0.97, spread_ms=0.02, matched=True)
    clear = trials.Trial("souffle", ms=0.90, spread_ms=0.02, matched=True)
    assert trials.pick([base, close], "tvm")[0] is base
    assert trials.pick([base, clear], "tvm")[0] is clear
    assert trials.pick([base, trials.Trial("x", ms=0.1, spread_ms=0.0, matched=False)], "tvm")[0] is base
    assert trials.pick([trials.Trial("x", note="failed to run: ...")], "tvm")[0] is None


def test_a_killed_compile_leaves_no_partial_cache_entry(tmp_path):
    cache = tmp_path / "cache"
    env = {**os.environ, "SOUFFLE_TVM_CACHE": str(cache), "SOUFFLE_TVM_CACHE_WRITE_PAUSE": "60",
           "SOUFFLE_TVM_PROGRESS": "0"}
    exe = [sys.executable, "-m", "souffle_tvm.cli", "compile", "mmoe", "--small", "--target", "llvm",
           "--fusion", "souffle", "--measure"]
    proc = subprocess.Popen(exe, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 240
    timing_dir = cache / "timing"
    try:
        while not (timing_dir.exists() and any(p.name.endswith(".tmp") for p in timing_dir.iterdir())):
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "the compile never started writing its timing cache"
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    # killed inside the first write: no cache file, only the temporary one no reader opens
    assert not any(p.suffix == ".json" for p in timing_dir.iterdir()), list(timing_dir.iterdir())
    done = subprocess.run(exe, env={**env, "SOUFFLE_TVM_CACHE_WRITE_PAUSE": ""}, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    (saved,) = [p for p in timing_dir.iterdir() if p.suffix == ".json"]
    data = json.loads(saved.read_text())
    assert all(c["runs"] == timing.REPEAT for c in data["candidates"].values() if c.get("ms") is not None)


def test_measuring_options_that_cannot_apply_are_refused(cache):
    with pytest.raises(OptionsError, match="--fusion souffle --level auto"):
        compile_model("mmoe", "llvm", "tvm", small=True, measure=True)
    with pytest.raises(OptionsError, match="--fusion souffle --level auto"):
        compile_model("mmoe", "llvm", "souffle", small=True, level="v2", rpc_tracker="127.0.0.1:1", rpc_key="x")
    with pytest.raises(MeasureError, match="needs a GPU"):
        compile_model("mmoe", "cuda", "souffle", small=True, measure=True, nvcc=False)
    with pytest.raises(MeasureError, match="go together"):
        compile_model("mmoe", "llvm", "souffle", small=True, rpc_tracker="127.0.0.1:1")


def test_a_corrupt_cache_is_started_again_with_a_note(tmp_path):
    info = {"kind": "cpu", "name": "test cpu", "cores": 2, "where": "local"}
    path = tmp_path / "timing" / f"{device_id(info)}.json"
    path.parent.mkdir(parents=True)
    path.write_text('{"version": 1, "kern')
    with pytest.warns(UserWarning, match="timing on this device again"):
        c = TimingCache.for_device(info, tmp_path)
    assert c.kernels == {} and c.candidates == {}


def test_measure_through_a_real_rpc_tracker(cache, tmp_path):
    with rpc_farm(tmp_path) as (port, server_log):
        compiled = compile_model("mmoe", "llvm", "souffle", small=True, measure=True,
                                 rpc_tracker=f"127.0.0.1:{port}", rpc_key=KEY)
        log = server_log.read_text()
    m = compiled.report.measured
    assert m["device"]["where"] == f"127.0.0.1:{port}/{KEY}" and "via RPC" in m["where"]
    assert "load_module" in log and "candidate-" in log and "kernels-" in log   # run there, not here
    assert all(c["matched"] is True for c in m["candidates"])
    _kept_is_justified(m)
    assert all(k.timed == "here" for k in compiled.report.kernels)


def test_the_html_page_shows_what_was_measured(cache, tmp_path):
    from souffle_tvm.report import html, measured_html

    compiled = compile_model("mmoe", "llvm", "souffle", small=True, measure=True)
    page = html.render(compiled.report)
    m = compiled.report.measured
    assert f"Measured on {m['where']}" in page
    for c in m["candidates"]:
        assert f"<td class=n>{c['ms']:.4f}</td>" in page
    assert "aria-label='measured time per candidate'" in page      # on a CPU nothing is predicted: bars
    # with predictions beside the measurements (a GPU), the plot is predicted against measured
    for k in compiled.report.kernels:
        k.predicted_us = 2 * k.measured_us
    assert "aria-label='predicted against measured time'" in measured_html.plot(compiled.report)
    assert measured_html.plot(compiled.report).count("<circle") == len(compiled.report.kernels)
