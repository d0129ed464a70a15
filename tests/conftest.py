import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from souffle_tvm import zoo
from souffle_tvm.runtime import runner
from souffle_tvm.pipeline.driver import compile as compile_model

ZOO = zoo.names()
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def llvm_builds():
    """Small zoo models built once per session for llvm: {(name, dtype): Compiled}."""
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


def run_and_compare(compiled, seed: int = 0):
    feeds = runner.random_inputs(compiled.model.inputs, seed)
    outs = runner.run_vm(compiled.executable, compiled.model.params, runner.check_feeds(compiled.model.inputs, feeds))
    _, ref = runner.reference_outputs(compiled.model.onnx_model, feeds)
    return runner.compare(compiled.model.outputs, outs, ref)


def emulated_comparisons(m, mod, params, seed: int = 0):
    """Run ``mod``'s kernels in the GPU emulator on the CPU (seeded inputs) and compare every
    output with onnxruntime on the model's ONNX file."""
    import tvm

    from souffle_tvm.core.targets import make_target
    from souffle_tvm.runtime import emulate

    ex = tvm.compile(emulate.emulate_module(mod, make_target("cuda")), target=make_target("llvm"))
    feeds = runner.random_inputs(m.inputs, seed)
    outs = runner.run_vm(ex, params, runner.check_feeds(m.inputs, feeds))
    _, ref = runner.reference_outputs(m.onnx_model, feeds)
    return runner.compare(m.outputs, outs, ref)


def module_cli(*args: str, cwd) -> subprocess.CompletedProcess:
    """``python -m souffle_tvm.cli -q ARGS`` in a subprocess, this checkout first on the path."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "souffle_tvm.cli", "-q", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=600)


needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
