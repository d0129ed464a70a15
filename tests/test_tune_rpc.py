"""Tuning through a real TVM RPC tracker (issue 19): a tracker and one RPC server on 127.0.0.1,
started and stopped by the test, measure the candidates of ``souffle-tvm tune --rpc-tracker``
for llvm; a later ``compile --database`` uses the records.

test_tune.py only talks to a fake tracker socket, so MetaSchedule's ``RPCRunner`` was never
built there (it once failed on its first real use with an unexpected keyword argument).
"""

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from souffle_tvm import tune
from souffle_tvm.codegen import database
from souffle_tvm.errors import TuningError
from souffle_tvm.pipeline.driver import compile as compile_model

EXE = shutil.which("souffle-tvm", path=os.path.dirname(sys.executable)) or "souffle-tvm"
KEY = "cpu"
START_DEADLINE_S = 60


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(args: list[str], log_path) -> subprocess.Popen:
    # A session of its own: TVM's tracker and server each run their work in a child process,
    # and the whole group is killed at the end.
    with open(log_path, "w") as log:
        return subprocess.Popen([sys.executable, "-m", *args], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


@contextlib.contextmanager
def rpc_farm(tmp_path, key: str = KEY):
    """A TVM RPC tracker and one server registered under ``key``, both on 127.0.0.1: yields
    (tracker port, server log path); both are killed on exit, however the block ends."""
    port, server_port = _free_port(), _free_port()
    server_log = tmp_path / "rpc_server.log"
    procs = []
    try:
        # Both at once (each imports TVM twice, ~5 s apiece on two busy cores): the server
        # retries the tracker every 5 s until it answers.
        procs.append(_start(["tvm.exec.rpc_tracker", "--host", "127.0.0.1", "--port", str(port),
                             "--port-end", str(port + 1)], tmp_path / "rpc_tracker.log"))
        procs.append(_start(["tvm.exec.rpc_server", "--tracker", f"127.0.0.1:{port}", "--key", key,
                             "--host", "127.0.0.1", "--port", str(server_port), "--port-end", str(server_port + 1)],
                            server_log))
        deadline = time.monotonic() + START_DEADLINE_S
        while True:          # the tracker accepts connections
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert procs[0].poll() is None, (tmp_path / "rpc_tracker.log").read_text()
                assert time.monotonic() < deadline, "the RPC tracker did not start"
                time.sleep(0.2)
        while True:          # the server registered its key and is free
            try:
                if tune.check_tracker("127.0.0.1", port, key, timeout=5) >= 1:
                    break
            except TuningError:
                pass
            assert procs[1].poll() is None, server_log.read_text()
            assert time.monotonic() < deadline, f"no RPC server under key {key!r}: {server_log.read_text()[-2000:]}"
            time.sleep(0.5)
        yield port, server_log
    finally:
        for proc in reversed(procs):
            _stop(proc)


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
