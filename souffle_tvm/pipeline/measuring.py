"""``--level auto`` on a device: the candidate builds timed there and the measured fastest kept
(``measure.trials``), the report saying per candidate what was predicted and measured, and per
kernel whether its time was measured here, measured elsewhere or only predicted."""

from __future__ import annotations

import math
from dataclasses import asdict

import numpy as np

from ..cost import latency
from ..cost.measured import MeasuredTimes
from ..cost.timing_cache import TimingCache
from ..errors import SouffleError
from ..measure import timing, trials as measure_trials
from ..measure.device import Device
from ..runtime.numerics import default_tolerance, random_inputs, reference_outputs

BASELINE = "tvm"


def candidate(name: str, compiled) -> measure_trials.Candidate:
    """A finished build (``driver.Compiled``) as a candidate to measure."""
    report = compiled.report
    launch = {k.primfunc: (math.prod(k.grid), math.prod(k.block)) for k in report.kernels if k.grid and k.block}
    predicted = (report.latency or {}).get("graph_ms")
    rows = ([latency.row_inputs(asdict(k)) | {"primfunc": k.primfunc} for k in report.kernels]
            if report.target == "cuda" else [])
    return measure_trials.Candidate(name, compiled.executable, list(compiled.model.params), compiled.fused,
                                    dict(compiled.calls), launch, predicted, report.arch or "llvm", rows,
                                    bool(report.cuda_graph))


def reference(compiled, seed: int = 0) -> tuple[list[np.ndarray], list[np.ndarray] | None, str]:
    """The model's seeded inputs, in ``main``'s order, and the reference outputs for them
    (onnxruntime on the model; None where it cannot run it: the baseline's own outputs then)."""
    model = compiled.model
    feeds = random_inputs(model.inputs, seed)
    args = [np.asarray(feeds[i.name]).astype(i.dtype, copy=False) for i in model.inputs]
    try:
        name, outs = reference_outputs(model.onnx_model, feeds)
    except Exception as err:  # noqa: BLE001 - the runtimes' errors share no base class
        return args, None, f"TVM's build on the device (the reference runtime failed: {str(err)[:100]})"
    return args, [np.asarray(o) for o in outs], name


def choose(device: Device, builds: list[tuple[str, object]]) -> object:
    """Time ``builds`` ([(name, Compiled)], the baseline named ``tvm`` among them) on ``device``
    and return the one to keep, its report carrying every candidate's figures."""
    first = builds[0][1]
    args, ref, ref_name = reference(first)
    cache = TimingCache.for_device(device.info)
    cands = [candidate(n, c) for n, c in builds]
    tolerance = default_tolerance(first.model.precision)
    if ref is None:     # the baseline's outputs on the device are the reference
        base = next((c for c in cands if c.name == BASELINE), cands[0])
        try:
            ref = timing.inference(device, base.executable, args + base.params, repeat=1)[0]
        except Exception as err:  # noqa: BLE001 - nothing to check the candidates against
            raise SouffleError(f"--measure: no reference: {ref_name}, and {base.name}'s build did not run on "
                               f"{device.describe()}: {str(err).strip()[:150]}") from None
    trials = measure_trials.measure(device, cands, args, ref, tolerance, cache)
    kept, why = measure_trials.pick(trials, BASELINE)
    if kept is None:
        raise SouffleError(f"--measure: {why} on {device.describe()}: "
                           + "; ".join(f"{t.name}: {t.note}" for t in trials if t.note))
    chosen = dict(builds)[kept.name]
    report = chosen.report
    report.measured = {"device": device.info, "where": device.describe(), "reference": ref_name,
                       "tolerance": tolerance, "cache": str(cache.path), "chosen": kept.name, "why": why,
                       "candidates": [t.row() for t in trials]}
    _mark_kernels(report, kept, next(c for c in cands if c.name == kept.name))
    if kept.name == BASELINE and first is not chosen:
        report.fusion = "souffle"
        report.fallback = f"measured on {device.describe()}: {why}"
    return chosen


def _mark_kernels(report, trial: measure_trials.Trial, cand: measure_trials.Candidate) -> None:
    """Each kernel row: its time measured here, else measured elsewhere (the shipped times), else
    predicted only."""
    shipped = MeasuredTimes.load()
    funcs = cand.functions()
    for row in report.kernels:
        here = trial.kernels.get(row.primfunc)
        elsewhere = shipped.seconds(cand.kernel_key(row.primfunc, funcs[row.primfunc])) \
            if here is None and row.primfunc in funcs else None
        if here is not None:
            row.measured_us, row.timed = here["us"], "here"
        elif elsewhere is not None:
            row.measured_us, row.timed = round(elsewhere * 1e6, 4), "elsewhere"
        else:
            row.timed = "predicted"
