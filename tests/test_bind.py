"""--bind: a model input fixed at compile time, so control flow decided by it folds (issue 19)."""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from souffle_tvm.errors import ModelLoadError
from souffle_tvm.frontend.binding import parse_bind
from souffle_tvm.frontend.importer import import_onnx
from souffle_tvm.pipeline.driver import compile as compile_model
from souffle_tvm.runtime import runner

EXE = shutil.which("souffle-tvm", path=os.path.dirname(sys.executable)) or "souffle-tvm"


@pytest.fixture(scope="module")
def branching(tmp_path_factory):
    """PyTorch's dynamo export of a model that branches on a scalar configuration input: an If."""
    torch = pytest.importorskip("torch")
    import onnx

    class Branch(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

        def forward(self, x, mode):
            return torch.cond(mode > 0, lambda x: torch.relu(self.a(x)), lambda x: torch.tanh(self.b(x)), (x,))

    torch.manual_seed(0)
    model = Branch().eval()
    path = str(tmp_path_factory.mktemp("bind") / "branch.onnx")
    torch.onnx.export(model, (torch.randn(2, 8), torch.tensor(1)), path, dynamo=True, input_names=["x", "mode"])
    assert "If" in [n.op_type for n in onnx.load(path).graph.node]     # the export really branches
    return path, model, torch


def _cli(*args):
    return subprocess.run([EXE, *args], capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("fusion", ["tvm", "souffle"])
def test_a_bound_configuration_input_compiles_and_matches_onnxruntime(branching, fusion):
    path, model, torch = branching
    for mode in (1, -1):
        c = compile_model(path, "llvm", fusion, bind={"mode": mode})
        assert [i.name for i in c.model.inputs] == ["x"]          # the bound input is no input any more
        assert fusion == "tvm" or c.report.fallback is None
        x = runner.random_inputs(c.model.inputs, 3)["x"]
        (out,) = runner.run_vm(c.executable, c.model.params, [x])
        with torch.no_grad():
            want = model(torch.from_numpy(x), torch.tensor(mode)).numpy()
        assert np.linalg.norm(out - want) / np.linalg.norm(want) < 1e-5
        _, (ref,) = runner.reference_outputs(c.model.onnx_model, {"x": x})     # onnxruntime, same value
        assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-5


def test_cli_bind_checks_against_onnxruntime_and_the_error_names_the_option(branching):
    path = branching[0]
    proc = _cli("run", path, "--fusion", "souffle", "--bind", "mode=-1", "--check")
    assert proc.returncode == 0, proc.stderr
    assert "vs onnxruntime" in proc.stdout and "MISMATCH" not in proc.stdout
    proc = _cli("run", path, "--fusion", "souffle")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "'mode'" in last and "--bind mode=VALUE" in last
    proc = _cli("compile", path, "--target", "llvm", "--bind", "nope=1")
    assert proc.returncode == 2 and "no such input" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_bind_values_parse_and_bad_ones_are_named(tmp_path):
    np.save(tmp_path / "v.npy", np.arange(3))
    got = parse_bind(["a=3", "b=0.5", "c=true", f"d={tmp_path / 'v.npy'}"])
    assert got["a"] == 3 and got["b"] == 0.5 and got["c"] is True and list(got["d"]) == [0, 1, 2]
    for bad in (["a"], ["a=x"], [f"a={tmp_path / 'missing.npy'}"]):
        with pytest.raises(ModelLoadError, match="--bind"):
            parse_bind(bad)


def test_a_bound_value_of_the_wrong_shape_is_refused():
    with pytest.raises(ModelLoadError, match="shape"):
        import_onnx("mmoe", small=True, bind={"features": np.zeros((3, 3), "float32")})
