"""The candidates of a compile, each timed on the device through its timing cache, checked
against the reference, and the one to keep.

A candidate is a finished build (TVM's kernels, Souffle's default, Souffle's budget v3...). Its
trial is timed whole and per kernel once per device: a candidate or kernel already in the
device's cache (``cost.timing_cache``) is read from it, not run again, and the cache is saved
after each candidate that was timed (written whole: a killed compile loses at most the
candidate it was timing). A candidate whose outputs do not match the reference is never
kept; the fastest that matches is kept only where it beats the baseline (TVM's build) by more
than the measured noise.
"""

from __future__ import annotations

import hashlib
import traceback
from dataclasses import dataclass, field

import numpy as np
import tvm
import tvm_ffi
from tvm import relax, tirx

from ..core import progress
from ..cost.measured import kernel_key
from ..cost.timing_cache import TimingCache
from ..runtime.numerics import compare
from . import timing
from .device import Device


@dataclass
class Candidate:
    """A build to measure: its executable, the module it was built from (whose PrimFuncs are
    its kernels), each kernel's launches per inference and launch shape, and its prediction."""
    name: str
    executable: relax.Executable
    params: list[np.ndarray]           # its weights, after ``main``'s inputs (each build folds its own)
    fused: tvm.IRModule | None
    calls: dict[str, int] = field(default_factory=dict)
    launch: dict[str, tuple[int, int]] = field(default_factory=dict)   # kernel -> (grid, block), CUDA
    predicted_ms: float | None = None
    arch: str = "llvm"
    rows: list[dict] = field(default_factory=list)     # GPU: each kernel's inputs to the latency model
    graphs: bool = False                               # GPU: launched from CUDA graphs

    def row_of(self, name: str) -> dict | None:
        return next((r for r in self.rows if r.get("primfunc") == name), None)

    def functions(self) -> dict[str, tirx.PrimFunc]:
        if self.fused is None:
            return {}
        return {gv.name_hint: f for gv, f in self.fused.functions.items()
                if isinstance(f, tirx.PrimFunc) and self.calls.get(gv.name_hint, 0) > 0}

    def kernel_key(self, name: str, func: tirx.PrimFunc) -> str:
        grid, block = self.launch.get(name, (1, 1))
        return kernel_key(func, self.arch, grid, block)


@dataclass
class Trial:
    """What measuring one candidate found. ``ms`` None: it could not be timed (``note`` says why)."""
    name: str
    ms: float | None = None
    spread_ms: float | None = None
    runs: int = 0
    matched: bool | None = None
    rel_l2: float | None = None
    predicted_ms: float | None = None
    cached: bool = False
    note: str | None = None
    kernels: dict[str, dict] = field(default_factory=dict)   # kernel name -> {"us", "spread_us", "key"}

    def row(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "kernels"}


def digest(arrays: list[np.ndarray]) -> str:
    """A digest of the inputs and weights a candidate is run with (its reference depends on them)."""
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(f"{a.shape}{a.dtype}".encode())
        h.update(a.tobytes())
    return h.hexdigest()[:16]


def build_key(candidate: Candidate, data: str) -> str:
    """A candidate's key in the cache: the module it built (structure, not names) and its data."""
    struct = tvm_ffi.structural_hash(candidate.fused) if candidate.fused is not None else "none"
    return f"{candidate.arch}|{struct:016x}|{data}" if candidate.fused is not None else f"{candidate.arch}|none|{data}"


def _one_line(err: Exception) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:200]


def measure(device: Device, candidates: list[Candidate], inputs: list[np.ndarray], reference: list[np.ndarray],
            tolerance: float, cache: TimingCache) -> list[Trial]:
    """Each candidate's trial: from the cache where it was measured before, else run here
    (a candidate that builds the same module as an earlier one is timed once)."""
    data = digest(inputs + reference)
    trials, seen = [], {}
    for i, cand in enumerate(candidates):
        key = build_key(cand, data + digest(cand.params))
        known = cache.candidates.get(key)
        funcs = cand.functions()
        keys = {name: cand.kernel_key(name, f) for name, f in funcs.items()}
        if known is not None:
            trial = Trial(cand.name, known.get("ms"), known.get("spread_ms"), known.get("runs", 0), known.get("matched"),
                          known.get("rel_l2"), cand.predicted_ms, cached=key not in seen,
                          note=f"the same build as {seen[key]}" if key in seen else known.get("note"))
        else:
            progress.step(f"measuring candidate {i + 1}/{len(candidates)} ({cand.name}) on {device.describe()}")
            trial = _run(device, cand, inputs + list(cand.params), reference, tolerance)
            cache.candidates[key] = {"name": cand.name} | {k: v for k, v in trial.row().items()
                                                           if k not in ("name", "cached", "predicted_ms")}
            if cand.rows:       # what ``souffle-tvm fit`` prices this total from
                cache.candidates[key] |= {"kernels": cand.rows, "graphs": cand.graphs}
        seen.setdefault(key, cand.name)
        dirty = known is None
        if trial.ms is not None:
            todo = {n: f for n, f in funcs.items() if keys[n] not in cache.kernels}
            if todo:
                dirty = True
                try:
                    for name, t in timing.kernels(device, cand.executable, todo).items():
                        cache.add_kernel(keys[name], t.seconds * 1e6, t.spread * 1e6, t.runs, cand.row_of(name))
                except Exception as err:  # noqa: BLE001 - per-kernel times are extra: the trial stands
                    trial.note = f"per-kernel times not measured: {_one_line(err)}"
            trial.kernels = {n: {"key": keys[n], **cache.kernels[keys[n]]} for n in funcs if keys[n] in cache.kernels}
        if dirty:
            cache.save()
        trials.append(trial)
    return trials


def _run(device: Device, cand: Candidate, args: list[np.ndarray], reference: list[np.ndarray],
         tolerance: float) -> Trial:
    trial = Trial(cand.name, predicted_ms=cand.predicted_ms)
    try:
        outputs, t = timing.inference(device, cand.executable, args)
    except Exception as err:  # noqa: BLE001 - a candidate that fails to load or run is dropped, not fatal
        trial.note = f"failed to run: {_one_line(err)}"
        if progress.wanted() and not isinstance(err, tvm.error.TVMError):
            traceback.print_exc()
        return trial
    trial.ms, trial.spread_ms, trial.runs = t.seconds * 1e3, t.spread * 1e3, t.runs
    try:
        comparisons = compare([f"output {i}" for i in range(len(outputs))], outputs, reference)
    except Exception as err:  # noqa: BLE001 - an output count that differs is a mismatch
        trial.matched, trial.note = False, f"outputs do not match the reference: {_one_line(err)}"
        return trial
    trial.rel_l2 = max((c.rel_l2 for c in comparisons), default=0.0)
    trial.matched = all(c.ok(tolerance) for c in comparisons)
    if not trial.matched:
        trial.note = f"outputs do not match the reference (rel L2 {trial.rel_l2:.2e}, tolerance {tolerance:.0e})"
    return trial


def pick(trials: list[Trial], baseline: str) -> tuple[Trial | None, str]:
    """The trial to keep and why: the fastest that matched, where it beats the baseline's time by
    more than the noise of both (their interquartile ranges); otherwise the baseline."""
    ok = [t for t in trials if t.matched and t.ms is not None]
    if not ok:
        return None, "no candidate ran and matched the reference"
    best = min(ok, key=lambda t: t.ms)
    base = next((t for t in ok if t.name == baseline), None)
    if base is None or best is base:
        return best, f"{best.name} measured fastest ({best.ms:.4f} ms)"
    noise = max(best.spread_ms or 0.0, base.spread_ms or 0.0)
    if best.ms + noise < base.ms:
        return best, (f"{best.name} measured fastest: {best.ms:.4f} ms against {base.ms:.4f} ms for {base.name}, "
                      f"more than the noise ({noise:.4f} ms)")
    return base, (f"{best.name} measured {best.ms:.4f} ms against {base.ms:.4f} ms for {base.name}, within the "
                  f"noise ({noise:.4f} ms): {base.name} kept")
