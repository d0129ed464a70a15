"""Single-op models a conformance sweep finds gaps in (issue 18, class 6): zero, reflection and
replication padding, Clip, PReLU with per-channel slopes, Tile.

Each is a small torch module (the op after a conv or linear layer, as in a real network)
exported by torch's legacy exporter, which writes ``F.pad``'s amounts as ConstantOfShape/
Concat/Reshape/Slice/Transpose/Cast over constants and Clip's bounds through TVM's NaN guard
(an opaque ``call_tir`` in the imported module). Before the fix: every padding mode failed to
import ("Dynamic pads are not supported yet"), and Clip and Tile crashed re-emitting an opaque
``call_tir`` at ``--fusion souffle`` ("ty_args should have exactly 1 output type"). Each runs
on llvm through both fusions against onnxruntime and builds for CUDA sm_90 with nvcc at
``--fusion tvm``, v2 and v3.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import onnx
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from conftest import needs_nvcc
from souffle_tvm.pipeline.driver import compile as compile_model
from souffle_tvm.runtime import runner

ROOT = Path(__file__).resolve().parent.parent


class Pad(nn.Module):
    def __init__(self, mode: str):
        super().__init__()
        self.mode, self.conv = mode, nn.Conv2d(4, 4, 3)

    def forward(self, x):
        if self.mode == "constant":
            return self.conv(nn.ZeroPad2d((1, 2, 1, 0))(x))
        return self.conv(F.pad(x, (1, 1, 2, 1), mode=self.mode))


class Clip(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 1)

    def forward(self, x):
        return torch.clamp(self.conv(x), -0.5, 0.75) + F.relu6(x)


class PReLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.act = nn.Conv2d(4, 4, 1), nn.PReLU(4)
        with torch.no_grad():
            self.act.weight.copy_(torch.tensor([-0.5, 0.1, 0.25, 0.9]))   # one slope per channel

    def forward(self, x):
        return self.act(self.conv(x))


class Tile(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tile(self.lin(x.flatten(2)), (1, 2, 3)) * 2


OPS = {"pad-constant": (lambda: Pad("constant"), (2, 4, 8, 8)), "pad-reflect": (lambda: Pad("reflect"), (2, 4, 8, 8)),
       "pad-edge": (lambda: Pad("replicate"), (2, 4, 8, 8)), "clip": (Clip, (2, 4, 8, 8)),
       "prelu": (PReLU, (2, 4, 8, 8)), "tile": (Tile, (2, 4, 2, 4))}


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("ops")
    paths = {}
    for name, (make, shape) in OPS.items():
        torch.manual_seed(0)
        path = str(folder / f"{name}.onnx")
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            torch.onnx.export(make().eval(), (torch.randn(*shape),), path, input_names=["x"], output_names=["y"],
                              opset_version=17, dynamo=False)
        paths[name] = path
    return paths


def test_exports_contain_the_ops(exports):
    def nodes(name):
        return onnx.load(exports[name]).graph.node

    for mode in ("constant", "reflect", "edge"):
        (pad,) = [n for n in nodes(f"pad-{mode}") if n.op_type == "Pad"]
        assert onnx.helper.get_attribute_value(pad.attribute[0]).decode() == mode
        assert any(n.op_type == "ConstantOfShape" for n in nodes(f"pad-{mode}"))   # pads computed in the graph
    assert sum(n.op_type == "Clip" for n in nodes("clip")) == 2
    (prelu,) = [n for n in nodes("prelu") if n.op_type == "PRelu"]
    slope = {t.name: t for t in onnx.load(exports["prelu"]).graph.initializer}[prelu.input[1]]
    assert list(slope.dims) == [4, 1, 1]
    assert any(n.op_type == "Tile" for n in nodes("tile"))


@pytest.mark.parametrize("fusion", ["tvm", "souffle"])
@pytest.mark.parametrize("name", list(OPS))
def test_op_matches_onnxruntime_on_llvm(exports, name, fusion):
    compiled = compile_model(exports[name], "llvm", fusion)
    if fusion == "souffle":
        assert compiled.report.fusion == "souffle" and not compiled.report.fallback, compiled.report.fallback
    feeds = runner.random_inputs(compiled.model.inputs, 7)
    outs = runner.run_vm(compiled.executable, compiled.model.params, runner.check_feeds(compiled.model.inputs, feeds))
    _, ref = runner.reference_outputs(compiled.model.onnx_model, feeds)
    (c,) = runner.compare(compiled.model.outputs, outs, ref)
    assert c.finite and c.rel_l2 < 1e-5, f"{name}/{fusion}: rel L2 {c.rel_l2:.2e}"


@needs_nvcc
@pytest.mark.parametrize("fusion,level", [("tvm", "v2"), pytest.param("souffle", "v2", marks=pytest.mark.slow),
                                          ("souffle", "v3")])
@pytest.mark.parametrize("name", list(OPS))
def test_op_builds_for_cuda_with_nvcc(exports, name, fusion, level):
    r = compile_model(exports[name], "cuda", fusion, arch="sm_90", level=level).report
    assert r.nvcc["available"] and r.kernels and all(k.registers for k in r.kernels)
    if fusion == "souffle":
        assert not r.fallback, r.fallback


@pytest.mark.slow
def test_cli_runs_a_clipped_and_a_reflect_padded_model(exports, tmp_path):
    # as a user meets them: `souffle-tvm run --check` at --fusion souffle --level v3
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    for name in ("clip", "pad-reflect"):
        proc = subprocess.run([sys.executable, "-m", "souffle_tvm.cli", "-q", "run", exports[name], "--check",
                               "--fusion", "souffle", "--level", "v3"], capture_output=True, text=True, env=env,
                              cwd=tmp_path, timeout=600)
        assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
        (line,) = [ln for ln in proc.stdout.splitlines() if ln.strip().startswith("check y vs")]
        assert float(re.search(r"rel L2 (\S+)", line).group(1)) < 1e-5, line
