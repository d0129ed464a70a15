"""``souffle-tvm fit`` (issue 57, item 4): the latency model refitted on one device's timing
cache, and later compiles on that device pricing with the refitted constants.

No GPU here: the cache is filled with times planted from known constants on the kernels real
CUDA builds of the zoo produce (their report rows, exactly what ``compile --measure`` stores on
a GPU), so the fit must find constants that reproduce them; a fit that ignores the cache, or a
compile that ignores the refitted constants, fails."""

import dataclasses
import json
import subprocess
import sys
from dataclasses import asdict

import pytest

from souffle_tvm.cost import device_fit, fit, latency, prior
from souffle_tvm.cost.hardware import GPUS
from souffle_tvm.cost.timing_cache import TimingCache
from souffle_tvm.pipeline import driver
from souffle_tvm.pipeline.driver import compile as compile_model

H200 = GPUS["h200"]
PLANTED = dataclasses.replace(latency.FITTED, node_us=2.4, sync_us=3.0, warp_gbps=2.5, latency_us=1.2)
DEVICE = {"kind": "cuda", "name": "NVIDIA H200", "sms": 132, "compute": "9.0", "cuda": 13000, "driver": 580,
          "where": "local"}


@pytest.fixture(scope="module")
def builds():
    return [compile_model(m, "cuda", f, small=True, level="v3" if f == "souffle" else "auto")
            for m in ("mmoe", "bert") for f in ("tvm", "souffle")]


def _planted_cache(tmp_path, builds) -> TimingCache:
    cache = TimingCache.for_device(DEVICE, tmp_path)
    for i, b in enumerate(builds):
        rows = [latency.row_inputs(asdict(k)) | {"primfunc": k.primfunc} for k in b.report.kernels]
        kernels = latency.kernels_from_rows(rows)
        cache.candidates[f"build{i}"] = {"name": b.report.model, "ms": fit.predict_ms(H200, PLANTED, {
            "kernels": kernels, "graphs": True}), "matched": True, "kernels": rows, "graphs": True}
        for j, row in enumerate(rows):
            (k,) = latency.kernels_from_rows([row | {"launches": 1}])
            cache.add_kernel(f"k{i}-{j}", fit.predict_kernel_us(H200, PLANTED, {"kernel": k}), 0.0, 7, row)
    cache.save()
    return cache


def test_fit_finds_constants_that_reproduce_the_devices_times(tmp_path, builds):
    cache = _planted_cache(tmp_path, builds)
    r = device_fit.refit(TimingCache.load(cache.path), starts=1)
    assert r.totals == 4 and r.kernels >= 10
    assert r.before > 0.10            # the shipped constants do not fit this device
    assert r.after < 0.02             # the refitted ones do
    saved = TimingCache.load(cache.path)
    assert saved.fitted() == r.constants


def test_a_later_compile_on_that_device_prices_with_the_refitted_constants(tmp_path, builds, monkeypatch):
    monkeypatch.setenv("SOUFFLE_TVM_CACHE", str(tmp_path))
    cache = _planted_cache(tmp_path, builds)
    device_fit.refit(TimingCache.load(cache.path), starts=1)

    class Here:                       # the device the cache belongs to (no GPU here to reach it)
        info = DEVICE
    p = driver._device_prior(Here())
    assert p.constants == TimingCache.load(cache.path).fitted() != latency.FITTED
    assert "fitted on NVIDIA H200" in p.source
    with prior.using(p):
        compiled = compile_model("mmoe", "cuda", "souffle", small=True, measure=False)
    got = compiled.report.latency["constants"]
    assert got == pytest.approx(p.constants.as_dict())
    plain = compile_model("mmoe", "cuda", "souffle", small=True, measure=False)
    assert plain.report.latency["constants"] == pytest.approx(latency.FITTED.as_dict())
    assert plain.report.latency["graph_ms"] != compiled.report.latency["graph_ms"]


def test_the_fit_command(tmp_path, builds):
    cache = _planted_cache(tmp_path, builds)
    out = subprocess.run([sys.executable, "-m", "souffle_tvm.cli", "fit", "--cache", str(cache.path)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "before" in out.stdout and "after" in out.stdout and "written to" in out.stdout
    assert json.loads(cache.path.read_text())["constants"]
    cpu = TimingCache.for_device({"kind": "cpu", "name": "a CPU", "where": "local"}, tmp_path / "cpu")
    cpu.save()
    out = subprocess.run([sys.executable, "-m", "souffle_tvm.cli", "fit", "--cache", str(cpu.path)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert "prices GPUs" in out.stderr
