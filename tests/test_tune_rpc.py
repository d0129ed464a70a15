"""Tuning through a real TVM RPC tracker (issue 19): a tracker and one RPC server on 127.0.0.1,
started and stopped by the test, measure the candidates of ``souffle-tvm tune --rpc-tracker``
for llvm; a later ``compile --database`` uses the records.

test_tune.py only talks to a fake tracker socket, so MetaSchedule's ``RPCRunner`` was never
built there (it once failed on its first real use with an unexpected keyword argument).
"""

import os
import shutil
import subprocess
import sys
import time

import pytest

from souffle_tvm import tune
from souffle_tvm.codegen import database
from souffle_tvm.errors import TuningError
from souffle_tvm.pipeline.driver import compile as compile_model

from rpc_farm import rpc_farm

EXE = shutil.which("souffle-tvm", path=os.path.dirname(sys.executable)) or "souffle-tvm"
KEY = "cpu"


@pytest.fixture(scope="module")
def farm(tmp_path_factory):
    with rpc_farm(tmp_path_factory.mktemp("rpc")) as out:
        yield out


def test_tune_through_a_real_rpc_tracker_then_compile_uses_the_records(tmp_path, farm):
    port, server_log = farm
    db = str(tmp_path / "db")
    t = time.perf_counter()
    proc = subprocess.run([EXE, "tune", "mmoe", "--small", "--target", "llvm", "--database", db,
                           "--rpc-tracker", f"127.0.0.1:{port}", "--rpc-key", KEY,
                           "--trials", "4", "--max-stages", "1"],
                          capture_output=True, text=True, timeout=240)
    seconds = time.perf_counter() - t
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    # the candidates were measured by the RPC server, not by a local runner
    assert "load_module" in server_log.read_text()
    print(f"tune through the tracker: {seconds:.1f} s")
    assert "[1/1] souffle_matmul_h4: " in proc.stdout and "best" in proc.stdout, proc.stdout
    assert 1 <= database.record_count(db) <= 4
    compiled = compile_model("mmoe", "llvm", "souffle", small=True, database=db)
    schedules = {k.primfunc: k.schedule for k in compiled.report.kernels}
    assert schedules["souffle_matmul_h4"] == "database"
    assert sum(s == "database" for s in schedules.values()) == 1


def test_rpc_runner_is_built_with_tvms_signature(farm):
    """``make_runner`` returns MetaSchedule's RPCRunner wired to the tracker (and its timeout)."""
    from tvm.s_tir import meta_schedule as ms

    from souffle_tvm.core.targets import make_target

    port, _ = farm
    runner = tune.make_runner(make_target("llvm"), f"127.0.0.1:{port}", KEY, timeout_s=17)
    assert isinstance(runner, ms.runner.RPCRunner)
    cfg = runner.rpc_config
    assert (cfg.tracker_host, int(cfg.tracker_port), cfg.tracker_key, cfg.session_timeout_sec) == \
        ("127.0.0.1", port, KEY, 17)


def test_real_tracker_without_the_key_fails_before_tuning(farm):
    port, _ = farm
    with pytest.raises(TuningError, match=f"no server registered with key 'h200'.*keys: {KEY}"):
        tune.make_runner(None, f"127.0.0.1:{port}", "h200")
