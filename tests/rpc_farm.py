"""A real TVM RPC tracker and one RPC server on 127.0.0.1, started and killed by the tests that
measure through them (``tune --rpc-tracker``, ``compile --measure --rpc-tracker``)."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

from souffle_tvm.errors import MeasureError
from souffle_tvm.measure.device import check_tracker

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
                if check_tracker("127.0.0.1", port, key, timeout=5) >= 1:
                    break
            except MeasureError:
                pass
            assert procs[1].poll() is None, server_log.read_text()
            assert time.monotonic() < deadline, f"no RPC server under key {key!r}: {server_log.read_text()[-2000:]}"
            time.sleep(0.5)
        yield port, server_log
    finally:
        for proc in reversed(procs):
            _stop(proc)
