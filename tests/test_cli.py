"""The CLI through its real entry point, in a subprocess, as a shell script would use it."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import needs_nvcc

EXE = shutil.which("souffle-tvm", path=os.path.dirname(sys.executable)) or "souffle-tvm"


def cli(*args, cwd=None, ok=(0,)):
    proc = subprocess.run([EXE, *args], capture_output=True, text=True, cwd=cwd, timeout=600)
    assert proc.returncode in ok, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def test_help_and_zoo_list():
    out = cli("--help").stdout
    for word in ("compile", "run", "zoo", "exit codes"):
        assert word in out
    listing = cli("zoo", "list").stdout
    for name in ("bert", "resnext", "lstm", "efficientnet", "swin", "mmoe"):
        assert name in listing
    assert "--fusion" in cli("compile", "--help").stdout


def test_export_compile_library_run_roundtrip(tmp_path):
    cli("zoo", "export", "mmoe", "--small", "-o", "m.onnx", cwd=tmp_path)
    cli("compile", "m.onnx", "--target", "llvm", "-o", "m.so", "--report", "r.json", cwd=tmp_path)
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["target"] == "llvm" and report["fusion"] == "tvm" and report["launches"] >= 1
    rng = np.random.default_rng(5)
    np.savez(tmp_path / "in.npz", features=rng.standard_normal((1, 32)).astype(np.float32))
    cli("run", "m.so", "--inputs", "in.npz", "--outputs", "lib_out.npz", cwd=tmp_path)
    checked = cli("run", "m.onnx", "--inputs", "in.npz", "--outputs", "onnx_out.npz", "--check", cwd=tmp_path)
    assert "ok" in checked.stdout and "MISMATCH" not in checked.stdout
    a, b = np.load(tmp_path / "lib_out.npz"), np.load(tmp_path / "onnx_out.npz")
    assert set(a.files) == {"task0", "task1"}
    for k in a.files:
        np.testing.assert_array_equal(a[k], b[k])


def test_errors_exit_2_with_a_message(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x08\x07\x12garbage")
    proc = cli("compile", str(bad), ok=(2,))
    assert proc.stderr.startswith("souffle-tvm: error:") and "Traceback" not in proc.stderr
    proc = cli("compile", "mmoe", "--small", "--fusion", "souffle", "--level", "v9", ok=(2,))
    assert "unknown level" in proc.stderr
    proc = cli("run", "mmoe", "--small", "--inputs", str(tmp_path / "none.npz"), ok=(2,))
    assert "none.npz" in proc.stderr and "Traceback" not in proc.stderr
    proc = cli("compile", "mmoe", "--small", "--target", "vulkan", ok=(2,))
    assert "unsupported target" in proc.stderr


@needs_nvcc
def test_compile_cuda_sm80_report(tmp_path):
    proc = cli("compile", "bert", "--small", "--target", "cuda -arch=sm_80", "--report", "b.json", cwd=tmp_path)
    report = json.loads((tmp_path / "b.json").read_text())
    assert report["arch"] == "sm_80" and report["nvcc"]["available"]
    assert report["launches"] == sum(k["launches"] for k in report["kernels"])
    assert "launches/inference" in proc.stdout


def test_souffle_compile_and_analyze(tmp_path):
    proc = cli("compile", "bert", "--small", "--target", "cuda", "--fusion", "souffle", "--no-nvcc",
               "--report", "s.json", cwd=tmp_path)
    report = json.loads((tmp_path / "s.json").read_text())
    # the default level, auto: v3 with the time-driven partitioner, compared with TVM's own build
    assert report["fusion"] == "souffle" and report["level"] == "v3" and report["groups"] and not report["fallback"]
    assert report["latency"]["graph_ms"] <= report["latency"]["tvm_graph_ms"]
    assert "boundaries" in proc.stdout and "TVM's own kernels, built to compare" in proc.stdout
    out = cli("analyze", "bert", "--small", "--json", "a.json", cwd=tmp_path).stdout
    assert "reduction" in out and "vertical transform" in out
    data = json.loads((tmp_path / "a.json").read_text())
    assert data["counts"]["reduction"] > 0 and data["vertical"]["inlined"]


@pytest.mark.slow
def test_full_bert_compiles_with_report(tmp_path):
    cli("compile", "bert", "--target", "cuda", "--report", "bert.json", cwd=tmp_path)
    assert json.loads((tmp_path / "bert.json").read_text())["launches"] > 100


def test_run_times_on_the_cpu_and_refuses_a_missing_gpu():
    out = cli("run", "mmoe", "--small", "--time", "5").stdout
    assert "median of 5 runs:" in out and " ms" in out
    # this machine has no GPU: a clear one-line error and exit 2, before anything is compiled
    proc = cli("run", "mmoe", "--small", "--target", "cuda", "--time", "5", ok=(2,))
    assert "no CUDA GPU" in proc.stderr and "Traceback" not in proc.stderr
    assert "building" not in proc.stderr


@needs_nvcc
def test_compile_with_cuda_graphs_reports_the_launches_left_outside(tmp_path):
    report = tmp_path / "r.json"
    out = cli("compile", "mmoe", "--small", "--cuda-graph", "--report", str(report)).stdout
    assert "built with TVM's CUDA-graph rewriting" in out and "predicted GPU time" in out
    r = json.loads(report.read_text())
    assert r["cuda_graph"]["replays"] > 0
    assert r["cuda_graph"]["captured_launches"] + r["cuda_graph"]["launches_outside"] == r["launches"]
    assert r["latency"]["graph_ms"] <= r["latency"]["rewrite_ms"] <= r["latency"]["ms"]
