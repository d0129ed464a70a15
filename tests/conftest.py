import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from souffle_tvm import zoo

# No TVM at import: the gpu-marked tests (tests/test_gpu.py) run on a GPU machine that has only
# TVM's runtime (`souffle_experiments gpu-check tests`); what needs the compiler imports it where used.
ZOO = zoo.names()


def zoo_but_slow(*heavy: str) -> list:
    """The zoo's names as parameters, ``heavy`` ones marked ``slow`` (they run in ``make test-all``):
    what keeps ``make test`` under its 20 minutes where the other models cover the same code."""
    return [pytest.param(n, marks=pytest.mark.slow) if n in heavy else n for n in ZOO]
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def llvm_builds():
    """Small zoo models built once per session for llvm: {(name, dtype): Compiled}."""
    from souffle_tvm.pipeline.driver import compile as compile_model

    cache = {}

    def get(name: str, dtype: str = "float32"):
        if (name, dtype) not in cache:
            cache[(name, dtype)] = compile_model(name, "llvm", "tvm", small=True, dtype=dtype)
        return cache[(name, dtype)]

    return get


@pytest.fixture(scope="session")
def v3_builds():
    """Small zoo models through the v3 pipeline for CUDA, once per session:
    name -> (ImportedModel, SouffleModule) (what the emulator tests run)."""
    from souffle_tvm.core.targets import make_target
    from souffle_tvm.frontend.importer import import_onnx
    from souffle_tvm.pipeline import results
    from souffle_tvm.pipeline.options import Options

    cache = {}

    def get(name: str):
        if name not in cache:
            m = import_onnx(name, small=True, dtype="float32")
            cache[name] = (m, results.run(m.mod, make_target("cuda"), m.params, Options(level="v3")))
        return cache[name]

    return get


def assert_floors_hold(report) -> None:
    """Every kernel of a CUDA report has its static floor (cost/floors.py) and block counts, and
    its predicted time is not below that floor."""
    for k in report.kernels:
        assert k.block_counts is not None and k.floor_by, k.name
        assert k.floor_us is not None and k.predicted_us is not None, k.name
        assert k.predicted_us >= k.floor_us, f"{k.name}: predicted {k.predicted_us} us below its floor {k.floor_us}"


def run_and_compare(compiled, seed: int = 0):
    from souffle_tvm.runtime import runner

    feeds = runner.random_inputs(compiled.model.inputs, seed)
    outs = runner.run_vm(compiled.executable, compiled.model.params, runner.check_feeds(compiled.model.inputs, feeds))
    _, ref = runner.reference_outputs(compiled.model.onnx_model, feeds)
    return runner.compare(compiled.model.outputs, outs, ref)


def emulated_comparisons(m, mod, params, seed: int = 0):
    """Run ``mod``'s kernels in the GPU emulator on the CPU (seeded inputs) and compare every
    output with onnxruntime on the model's ONNX file."""
    import tvm

    from souffle_tvm.core.targets import make_target
    from souffle_tvm.runtime import emulate, runner

    ex = tvm.compile(emulate.emulate_module(mod, make_target("cuda")), target=make_target("llvm"))
    feeds = runner.random_inputs(m.inputs, seed)
    outs = runner.run_vm(ex, params, runner.check_feeds(m.inputs, feeds))
    _, ref = runner.reference_outputs(m.onnx_model, feeds)
    return runner.compare(m.outputs, outs, ref)


def race_checked_in_orders(m, souffle, orders=("ascending", "descending", "shuffle:1"), seed: int = 0):
    """Run ``souffle``'s module in the race-checking emulator once per block order and yield
    (order, race report, comparisons with onnxruntime) for the caller to assert on."""
    from souffle_tvm.core.targets import make_target
    from souffle_tvm.runtime import races, runner

    emu = races.Emulation(souffle.mod, make_target("cuda"))
    feeds = runner.random_inputs(m.inputs, seed)
    _, ref = runner.reference_outputs(m.onnx_model, feeds)
    for order in orders:
        outs, report = emu.run(runner.check_feeds(m.inputs, feeds), souffle.params, order)
        yield order, report, runner.compare(m.outputs, outs, ref)


def module_cli(*args: str, cwd) -> subprocess.CompletedProcess:
    """``python -m souffle_tvm.cli -q ARGS`` in a subprocess, this checkout first on the path."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "souffle_tvm.cli", "-q", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=600)


# nvcc is part of this project's set-up (CUDA 13 on PATH, as on CI): a test that needs it fails
# loudly without it, rather than passing on a silent skip; SOUFFLE_TVM_ALLOW_NO_NVCC=1 skips
# those tests instead on a machine without CUDA.
NVCC_OPTIONAL = os.environ.get("SOUFFLE_TVM_ALLOW_NO_NVCC") == "1"


def require_nvcc() -> None:
    """Fail (or, with SOUFFLE_TVM_ALLOW_NO_NVCC=1, skip) the calling test where nvcc is not on PATH."""
    if shutil.which("nvcc") is None:
        why = "nvcc is not on PATH: this test checks generated CUDA with ptxas"
        if NVCC_OPTIONAL:
            pytest.skip(why)
        pytest.fail(f"{why} (install CUDA, or set SOUFFLE_TVM_ALLOW_NO_NVCC=1 to skip such tests)")


@pytest.fixture
def nvcc() -> None:
    require_nvcc()


needs_nvcc = pytest.mark.usefixtures("nvcc")


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
