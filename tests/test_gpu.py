"""Checks that need a CUDA GPU, marked ``gpu`` (skipped by default). They run on a lent GPU
through ``python -m souffle_experiments gpu-check tests --bundle DIR`` against a bundle ``gpu-check prepare``
built on the build machine (its cooperative-launch probes; ``--models`` with no names builds
only them). TVM-free: the GPU machine has TVM's runtime, torch and tvm_ffi only.
"""

import json
import os
from pathlib import Path

import pytest

# TVM-free (zoo, numerics, standalone); on the GPU machine `gpu-check tests` puts python/ on PYTHONPATH
from souffle_experiments import gpu_check

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def probes() -> tuple[Path, dict]:
    bundle = Path(os.environ.get("SOUFFLE_GPU_BUNDLE", ROOT / "gpu_bundle"))
    if not (bundle / "manifest.json").exists():
        pytest.fail(f"no GPU bundle at {bundle}: build one with `python -m souffle_experiments gpu-check prepare` (SOUFFLE_GPU_BUNDLE)")
    manifest = json.loads((bundle / "manifest.json").read_text())
    return bundle, {p["kind"]: p for p in manifest["probes"]}


def _run(probes, kind: str, timeout: float = 90) -> dict:
    bundle, by_kind = probes
    return gpu_check._run_probe(bundle, by_kind[kind], timeout)


def test_cooperative_grid_at_the_coresident_limit_is_right(probes):
    r = _run(probes, "coresident")
    assert r["outcome"] == "ran" and r["wrong_elements"] == 0, r


def test_cooperative_grid_over_the_limit_is_refused(probes):
    assert _run(probes, "oversized")["outcome"] == "refused"


def test_stitched_kernel_without_the_cooperative_flag_traps_instead_of_hanging(probes):
    # the pass form built with TVM's default TIR pipeline: its entry check traps at once
    r = _run(probes, "noflag", timeout=60)
    assert r["outcome"] == "refused", r
    assert r["seconds"] < 30, r
