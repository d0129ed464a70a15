"""Reaching a device to measure on: this CPU (llvm), the local GPU (CUDA), or a server behind
TVM's RPC tracker (``--rpc-tracker HOST:PORT --rpc-key KEY``, as ``tune`` takes them)."""

from __future__ import annotations

import os
import socket
import threading
from dataclasses import dataclass
from pathlib import Path

import tvm

from ..core.targets import is_cuda
from ..errors import MeasureError

TRACKER_TIMEOUT_S = 10.0
SESSION_TIMEOUT_S = 3600     # held from the start of a compile to its last candidate: long builds included


@dataclass
class Device:
    """Where candidates run: ``dev`` (local or remote), the RPC session if remote, and the
    device's identity (``info``: what its timing cache is keyed by)."""
    dev: object
    info: dict
    session: object | None = None

    @property
    def remote(self) -> bool:
        return self.session is not None

    def load(self, path: str | os.PathLike):
        """Load a library exported here onto the device (uploaded first when remote)."""
        if self.session is None:
            return tvm.runtime.load_module(str(path))
        self.session.upload(str(path))
        return self.session.load_module(Path(path).name)

    def describe(self) -> str:
        where = f" via RPC {self.info['where']}" if self.remote else ""
        return f"{self.info['name']}{where}"


def parse_tracker(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise MeasureError(f"--rpc-tracker {text!r} is not HOST:PORT (e.g. 127.0.0.1:9190)")
    return host, int(port)


def check_tracker(host: str, port: int, key: str, timeout: float = TRACKER_TIMEOUT_S) -> int:
    """Ask the tracker how many servers with ``key`` are free; raise a MeasureError within ``timeout``
    seconds when it cannot be reached, does not answer, or has none (TVM's own client retries
    a refused connection for a minute, and a port that accepts but never answers would hang)."""
    try:
        socket.create_connection((host, port), timeout=min(timeout, 5.0)).close()
    except OSError as err:
        raise MeasureError(f"cannot reach the RPC tracker at {host}:{port}: {err}") from None
    out: dict = {}

    def ask():
        try:
            from tvm import rpc

            out["queue"] = rpc.connect_tracker(host, port).summary().get("queue_info", {})
        except Exception as err:  # noqa: BLE001 - reported below as the tracker's failure
            out["error"] = err

    worker = threading.Thread(target=ask, daemon=True)   # daemon: a silent peer cannot keep us
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise MeasureError(f"{host}:{port} accepted a connection but did not answer as an RPC tracker "
                           f"within {timeout:.0f} s")
    if "error" in out:
        raise MeasureError(f"the RPC tracker at {host}:{port} failed: {out['error']}")
    if key not in out["queue"]:     # {key: {"free": n, "pending": m}} for every key ever registered
        known = ", ".join(sorted(out["queue"])) or "none"
        raise MeasureError(f"the RPC tracker at {host}:{port} has no server registered with key {key!r} (keys: {known})")
    return int(out["queue"][key].get("free", 0))


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu"


def _info(dev, kind: str, where: str = "local", name: str | None = None) -> dict:
    if kind == "cuda":
        return {"kind": "cuda", "name": dev.device_name, "sms": dev.multi_processor_count,
                "compute": dev.compute_version, "cuda": dev.api_version, "driver": dev.driver_version, "where": where}
    return {"kind": "cpu", "name": name or _cpu_name(), "cores": os.cpu_count() if where == "local" else None,
            "where": where}


def local_gpu():
    """The local CUDA device, or None (TVM built without CUDA, or no GPU)."""
    try:
        dev = tvm.cuda(0)
        return dev if tvm.runtime.enabled("cuda") and dev.exist else None
    except Exception:  # noqa: BLE001 - a TVM without its CUDA runtime raises here
        return None


def local_gpu_info() -> dict | None:
    """The local GPU's identity (what its timing cache is keyed by), or None."""
    dev = local_gpu()
    return None if dev is None else _info(dev, "cuda")


def reach(target: tvm.target.Target, measure: bool | None = None, rpc_tracker: str | None = None,
          rpc_key: str | None = None) -> Device | None:
    """The device to measure ``target``'s builds on, or None: ``measure`` False never measures;
    an RPC tracker is used when given; on CUDA a local GPU is used when present (``measure``
    None) and required when ``measure`` is True; on llvm this CPU is used only when asked."""
    if measure is False:
        if rpc_tracker or rpc_key:
            raise MeasureError("--no-measure with --rpc-tracker: the tracker is only used to measure")
        return None
    kind = "cuda" if is_cuda(target) else "cpu"
    if rpc_tracker or rpc_key:
        if not (rpc_tracker and rpc_key):
            raise MeasureError("--rpc-tracker and --rpc-key go together")
        host, port = parse_tracker(rpc_tracker)
        check_tracker(host, port, rpc_key)
        from tvm import rpc

        try:
            session = rpc.connect_tracker(host, port).request(rpc_key, session_timeout=SESSION_TIMEOUT_S)
        except Exception as err:  # noqa: BLE001 - TVM's RPC errors share no base class
            raise MeasureError(f"the RPC tracker at {host}:{port} gave no {rpc_key!r} server: {err}") from None
        dev = session.cuda(0) if kind == "cuda" else session.cpu(0)
        if kind == "cuda" and not dev.exist:
            raise MeasureError(f"the {rpc_key!r} server behind {host}:{port} has no CUDA device")
        return Device(dev, _info(dev, kind, f"{host}:{port}/{rpc_key}", name=None if kind == "cuda" else
                                 f"cpu of RPC key {rpc_key}"), session)
    if kind == "cuda":
        dev = local_gpu()
        if dev is None:
            if measure:
                raise MeasureError("--measure on CUDA needs a GPU: this machine has none (TVM CUDA runtime "
                                   f"{'present' if tvm.runtime.enabled('cuda') else 'absent'}); give "
                                   "--rpc-tracker HOST:PORT --rpc-key KEY, or compile without --measure")
            return None
        return Device(dev, _info(dev, "cuda"))
    return Device(tvm.cpu(0), _info(None, "cpu")) if measure else None
