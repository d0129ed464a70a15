"""Measured kernel times: a small JSON database shipped as package data
(``souffle_tvm/cost/data/measured.json``, ``cost.shipped``) that ``souffle_experiments gpu-check
record`` fills from a GPU run, merged with the user's own timing cache for the device compiled
for (``cost.timing_cache``); the time-driven partitioner prefers these over the latency model's
prediction where a kernel matches.

A kernel is keyed by the GPU architecture, the structural hash of its scheduled PrimFunc (which
fixes its code, dynamic shared memory included; the function's name does not count), its grid
and its block.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import tvm_ffi
from tvm import tirx

from ..core.files import atomic_write
from .shipped import MEASURED

DEFAULT_PATH = MEASURED
ENV = "SOUFFLE_MEASURED_TIMES"      # another database file (tests, other machines)


def kernel_key(func: tirx.PrimFunc, arch: str, grid: int, block: int) -> str:
    attrs = func.attrs
    if attrs is not None and "global_symbol" in attrs:
        func = func.without_attr("global_symbol")
    return f"{arch}|{tvm_ffi.structural_hash(func):016x}|{grid}|{block}"


@dataclass
class MeasuredTimes:
    """{kernel key: {"us": median GPU time of one launch, "gpu", "date", "source"}}."""
    entries: dict[str, dict] = field(default_factory=dict)

    def seconds(self, key: str | None) -> float | None:
        entry = self.entries.get(key) if key else None
        return entry["us"] * 1e-6 if entry else None

    def add(self, key: str, us: float, **meta) -> None:
        self.entries[key] = {"us": round(float(us), 3), **meta}

    @classmethod
    def load(cls, path: str | os.PathLike | None = None) -> "MeasuredTimes":
        p = Path(path or os.environ.get(ENV) or DEFAULT_PATH)
        if not p.exists():
            return cls()
        return cls(json.loads(p.read_text()).get("kernels", {}))

    def save(self, path: str | os.PathLike | None = None) -> Path:
        p = Path(path or os.environ.get(ENV) or DEFAULT_PATH)
        p.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(p, json.dumps({"kernels": self.entries}, indent=1, sort_keys=True))
        return p


# Schedule forms (``codegen.schedule.form_of``) that ran on a GPU inside a measured whole-model
# total (data/gpu runs 1-3, built at 8580722 and 44fa44f): TVM's own kernels (dlight's rules
# at their own block sizes) and the stitched stages of that time, all at 256 threads (dlight's
# GeneralReduction and Fallback; its Matmul at a 16 x 16 thread grid, which today's
# StitchedMatmul@256 is only where it keeps dlight's micro tile, so it is not counted). No form
# has a per-kernel time yet: every kernel's prediction is at best checked through a total.
TIMED_IN_TOTALS = frozenset({"dlight", "dlight Matmul", "dlight GEMV", "dlight Reduction", "dlight GeneralReduction",
                             "dlight Fallback", "GeneralReduction@256", "Fallback@256"})


def timed_in_a_total(form: str | None) -> bool:
    """Whether kernels of ``form`` ran on a GPU inside a measured total; a form with several
    stages ("a + b") only if every one did."""
    return bool(form) and all(f.strip() in TIMED_IN_TOTALS for f in form.split("+"))
