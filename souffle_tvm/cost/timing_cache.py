"""A timing cache per device, as TensorRT keeps one: what was measured on that device, so that
a later compile there times nothing twice and prefers what was measured to any prediction.

One JSON file per device (``$SOUFFLE_TVM_CACHE/timing/<device id>.json``), keyed by the device's
name, SM count (or cores), CUDA and driver versions; written whole (a temporary file renamed
over it, ``core.files.atomic_write``): a killed compile leaves the file as it was, never half an
entry. It holds

* ``kernels``: {kernel key (``cost.measured.kernel_key``): {"us", "spread_us", "runs"}}: one
  launch of that kernel on this device (median, interquartile range);
* ``candidates``: {build key: {"name", "ms", "spread_ms", "runs", "matched", "rel_l2", ...}}:
  one whole inference of a candidate build, and whether its outputs matched the reference;
* ``constants``: the latency model refitted on this device (``souffle-tvm fit``), or absent.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..core.files import atomic_write, cache_root, note_recomputed
from .latency import Constants
from .measured import MeasuredTimes

SUBDIR = "timing"
VERSION = 1


def device_id(device: dict) -> str:
    """The file name a device's cache is kept under: its identity, as a path-safe slug."""
    parts = [device.get(k) for k in ("kind", "name", "sms", "cores", "compute", "cuda", "driver", "where")]
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", "_".join(str(p) for p in parts if p not in (None, ""))).strip("-")


@dataclass
class TimingCache:
    path: Path
    device: dict
    kernels: dict[str, dict] = field(default_factory=dict)
    candidates: dict[str, dict] = field(default_factory=dict)
    constants: dict | None = None

    @classmethod
    def for_device(cls, device: dict, root: Path | None = None) -> "TimingCache":
        """The cache of ``device`` (empty if none was written yet, or if the file is unusable:
        then a one-line note says it is started again)."""
        path = (root or cache_root()) / SUBDIR / f"{device_id(device)}.json"
        return cls.load(path, device) if path.exists() else cls(path, device)

    @classmethod
    def load(cls, path: Path, device: dict | None = None) -> "TimingCache":
        """The cache in ``path`` (its device as the file names it, else ``device``)."""
        try:
            data = json.loads(path.read_text())
            if data.get("version") != VERSION:
                raise ValueError(f"version {data.get('version')}, not {VERSION}")
            return cls(path, data.get("device") or device or {}, dict(data["kernels"]), dict(data["candidates"]),
                       data.get("constants"))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            if device is None:
                raise ValueError(f"{path} is not a timing cache: {str(err)[:120]}") from None
            note_recomputed(path, str(err)[:120], "timing on this device again")
            return cls(path, device)

    @classmethod
    def all(cls, root: Path | None = None) -> list["TimingCache"]:
        """Every readable cache under ``root`` (default the project's cache folder)."""
        out = []
        for path in sorted(((root or cache_root()) / SUBDIR).glob("*.json")):
            try:
                out.append(cls.load(path))
            except ValueError:
                continue
        return out

    def save(self) -> Path:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(self.path, json.dumps({"version": VERSION, "device": self.device, "kernels": self.kernels,
                                            "candidates": self.candidates, "constants": self.constants},
                                           indent=1, sort_keys=True))
        return self.path

    def add_kernel(self, key: str, us: float, spread_us: float, runs: int, inputs: dict | None = None) -> None:
        """One kernel's time; ``inputs``: its row as the latency model prices it (GPU kernels), which
        ``souffle-tvm fit`` refits on."""
        self.kernels[key] = {"us": round(us, 4), "spread_us": round(spread_us, 4), "runs": runs,
                             "date": time.strftime("%Y-%m-%d")} | ({"inputs": inputs} if inputs else {})

    def measured_times(self, shipped: MeasuredTimes | None = None) -> MeasuredTimes:
        """The shipped times with this device's own over them (this device's are the judge)."""
        base = dict((shipped or MeasuredTimes.load()).entries)
        base.update({k: {"us": v["us"], "source": "timing cache"} for k, v in self.kernels.items()})
        return MeasuredTimes(base)

    def fitted(self) -> Constants | None:
        """The latency model's constants refitted on this device, if ``souffle-tvm fit`` ran."""
        if not self.constants:
            return None
        return Constants.fitted_from(self.constants)
