"""The latency model refitted on one device (``souffle-tvm fit``): its timing cache's measured
kernels and totals, each with the rows the model prices it from, fitted as the shipped
constants were (``cost.fit``); the error before and after, and the constants written back into
the cache, which later compiles on that device read as their prior (``cost.prior``)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import SouffleError
from . import fit, latency
from .hardware import GPU, GPUS, for_arch
from .timing_cache import TimingCache

MIN_POINTS = 3


@dataclass(frozen=True)
class Refit:
    gpu: str
    totals: int
    kernels: int
    before: float            # median |predicted / measured - 1| with the constants in force
    after: float             # with the refitted ones
    constants: latency.Constants


def gpu_of(device: dict) -> GPU:
    """The hardware table's entry for a device named by its timing cache."""
    name = str(device.get("name", "")).upper()
    for key, gpu in GPUS.items():
        if key.upper() in name:
            return gpu
    compute = str(device.get("compute") or "")
    if device.get("kind") != "cuda" or not compute:
        raise SouffleError(f"the latency model prices GPUs; {device.get('name')!r} is not one")
    return for_arch("sm_" + compute.replace(".", ""))


def points(cache: TimingCache) -> tuple[list[dict], list[dict]]:
    """(totals, kernels) as ``cost.fit`` takes them, from every cache entry with model inputs."""
    totals = [{"kernels": latency.kernels_from_rows(c["kernels"]), "graphs": bool(c.get("graphs")),
               "measured_ms": c["ms"]}
              for c in cache.candidates.values() if c.get("kernels") and c.get("ms") and c.get("matched")]
    kernels = [{"kernel": latency.kernels_from_rows([k["inputs"] | {"launches": 1}])[0], "measured_us": k["us"]}
               for k in cache.kernels.values() if k.get("inputs") and k.get("us")]
    return totals, kernels


def refit(cache: TimingCache, starts: int = 3) -> Refit:
    """Refit on ``cache`` and write the constants into it (saved)."""
    gpu = gpu_of(cache.device)
    totals, kernels = points(cache)
    if len(totals) + len(kernels) < MIN_POINTS:
        raise SouffleError(f"{cache.path} holds {len(totals)} measured totals and {len(kernels)} kernels with the "
                           f"model's inputs: at least {MIN_POINTS} are needed (compile with --measure on this device "
                           "first)")
    start = cache.fitted() or latency.FITTED
    before = fit.median_error(gpu, start, totals, kernels)
    consts = fit.fit(gpu, totals, start, kernels, starts=starts)
    after = fit.median_error(gpu, consts, totals, kernels)
    cache.constants = consts.as_dict()
    cache.save()
    return Refit(gpu.name, len(totals), len(kernels), before, after, consts)
