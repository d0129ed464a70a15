"""Tensor names from exporters that are not C identifiers (issue 18, class 1).

A torch export of the ViT (tests/torch_models.py) under the names of three exporters: torch's
own (``/layers.0/att/Constant_3_output_0``, ``layers.0.att.qkv.weight``), TF/Keras
(``model/layers/0/att/qkv_7/kernel:0``) and JAX (``jax2tf_fn_/Const_7``, with pairs that
collide once sanitized). Each is compiled for CUDA sm_90 through the CLI in a subprocess,
with nvcc, at ``--fusion tvm``, v2 and v3, and run on llvm against onnxruntime. Before the fix
nvcc rejected every one (``float* __restrict__ jax2tf_fn_/Const_7_ptr``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

import torch_models as tm
from conftest import needs_nvcc
from souffle_tvm.build import ptxas
from souffle_tvm.errors import ToolchainError
from souffle_tvm.frontend import names
from souffle_tvm.frontend.importer import import_onnx

ROOT = Path(__file__).resolve().parent.parent
FUSIONS = {"tvm": ["--fusion", "tvm"], "v2": ["--fusion", "souffle", "--level", "v2"],
           "v3": ["--fusion", "souffle", "--level", "v3"]}
# The default run builds two of the nine (the suite's time budget); all nine: `slow`.
DEFAULT = {("tf", "v2"), ("jax", "v3")}


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "souffle_tvm.cli", "-q", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=600)


def styled_vit(style: str, folder: Path) -> tuple[Path, onnx.ModelProto]:
    model = tm.rename(onnx.load(tm.export("vit", "legacy")), style)
    path = folder / f"vit-{style}.onnx"
    onnx.save(model, path)
    return path, model


def shapes_arg(model: onnx.ModelProto) -> str:
    (x,) = model.graph.input
    return f"{x.name}:{tm.BATCH}x3x32x32"


def test_c_identifiers_are_valid_distinct_and_keep_valid_names():
    raw = ["/layers.0/attn/Constant_3_output_0", "model/dense_2/BiasAdd:0", "jax2tf_fn_/Const_7",
           "jax2tf_fn_:Const_7", "jax2tf_fn_Const_7", "0", "float", "__x", "x", "layers.0.attn.qkv.weight"]
    got = names.c_identifiers(raw)
    assert len(set(got)) == len(raw)
    assert all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", g) for g in got), got
    assert got[4] == "jax2tf_fn_Const_7" and got[8] == "x"     # valid names stay, the others yield
    assert {got[2], got[3]} == {"jax2tf_fn_Const_7_1", "jax2tf_fn_Const_7_2"}
    assert got[6] != "float" and got[0] == "layers_0_attn_Constant_3_output_0"


@pytest.mark.parametrize("style", [pytest.param(s, marks=() if s == "jax" else pytest.mark.slow) for s in tm.NAME_STYLES])
def test_imported_parameters_are_c_identifiers_and_inputs_keep_onnx_names(style, tmp_path):
    path, model = styled_vit(style, tmp_path)
    m = import_onnx(str(path), shapes={model.graph.input[0].name: (tm.BATCH, 3, 32, 32)})
    params = [p.name for p in m.mod["main"].params]
    assert all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", p) for p in params), params
    assert len(set(params)) == len(params)
    assert [i.name for i in m.inputs] == [model.graph.input[0].name]
    assert m.outputs == [o.name for o in model.graph.output]
    assert m.names and all(re.search(r"[^A-Za-z0-9_]", old) for old in m.names.values())


MATRIX = [pytest.param(s, f, marks=() if (s, f) in DEFAULT else pytest.mark.slow, id=f"{s}-{f}")
          for s in tm.NAME_STYLES for f in FUSIONS]


@needs_nvcc
@pytest.mark.parametrize("style,fusion", MATRIX)
def test_styled_names_build_for_cuda_with_nvcc(style, fusion, tmp_path):
    path, model = styled_vit(style, tmp_path)
    proc = cli("compile", str(path), "--target", "cuda", "--arch", "sm_90", "--input-shapes", shapes_arg(model),
               *FUSIONS[fusion], "--report", "r.json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["nvcc"]["available"] and report["kernels"]
    assert all(k["registers"] for k in report["kernels"]), "every kernel went through ptxas"
    assert report["fusion"] == FUSIONS[fusion][1]
    if fusion != "tvm":
        assert not report.get("fallback"), report.get("fallback")
    if fusion == "v3":
        assert any(k["cooperative"] for k in report["kernels"])


LLVM_DEFAULT = {("jax", "souffle")}


@pytest.mark.parametrize("style,fusion", [pytest.param(s, f, marks=() if (s, f) in LLVM_DEFAULT else pytest.mark.slow,
                                                       id=f"{s}-{f}")
                                          for s in tm.NAME_STYLES for f in ("tvm", "souffle")])
def test_styled_names_match_onnxruntime_on_llvm(style, fusion, tmp_path):
    path, model = styled_vit(style, tmp_path)
    x = model.graph.input[0].name
    np.savez(tmp_path / "in.npz", **{x: tm.example_inputs("vit", seed=3)["x"]})
    proc = cli("run", str(path), "--inputs", "in.npz", "--check", "--fusion", fusion, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    (out,) = [o.name for o in model.graph.output]
    # the outputs are reported under their ONNX names, and match
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.strip().startswith(f"check {out} vs")]
    assert float(re.search(r"rel L2 (\S+)", line).group(1)) < 1e-5, line


NVCC_OUTPUT = "\n".join(
    ["kernels.cu(3): error: identifier \"Const_7_ptr\" is undefined",
     "      T[i] = jax2tf_fn_/Const_7_ptr[i];",
     "                        ^"]
    + [f"kernels.cu({10 + i}): warning #177-D: variable \"v{i}\" was declared but never referenced" for i in range(20)]
    + ["1 error detected in the compilation of \"kernels.cu\"."])


def test_nvcc_message_shows_the_first_errors_not_the_last_warnings():
    shown = ptxas.first_errors(NVCC_OUTPUT)
    assert 'error: identifier "Const_7_ptr" is undefined' in shown and "jax2tf_fn_/Const_7_ptr[i]" in shown
    assert "warning" not in shown


@needs_nvcc
def test_nvcc_failure_names_its_first_error(tmp_path, monkeypatch):
    # A real nvcc run: an error early in the file, then more warnings than the old 8-line tail.
    monkeypatch.setenv("SOUFFLE_TVM_CACHE", str(tmp_path))
    unused = "\n".join(f"__global__ void k{i}(float* p) {{ int unused{i} = {i}; p[0] = 1.0f; }}" for i in range(12))
    source = f"__global__ void bad(float* p) {{ p[0] = jax2tf_fn_/Const_7_ptr[0]; }}\n{unused}\n"
    with pytest.raises(ToolchainError) as err:
        ptxas.measure(source, "sm_90")
    message = str(err.value)
    assert 'identifier "jax2tf_fn_" is undefined' in message and "unused11" not in message, message
