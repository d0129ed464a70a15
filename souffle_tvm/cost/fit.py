"""Fitting the latency model's constants to measured times: whole-inference totals and single
kernels, each set weighing the same, each constant inside its plausible range
(``latency.RANGES``). ``souffle_experiments fit`` fits the shipped constants with it on the
project's GPU runs; ``souffle-tvm fit`` refits them on one device's timing cache
(``device_fit``)."""

from __future__ import annotations

import math
import statistics

import numpy as np

from . import latency
from .hardware import GPU


def predict_ms(gpu: GPU, consts: latency.Constants, point: dict) -> float:
    """A total's prediction: ``point["kernels"]`` launched with or without a CUDA graph."""
    return latency.predict(gpu, consts, point["kernels"], point["graphs"]).seconds * 1e3


def predict_kernel_us(gpu: GPU, consts: latency.Constants, point: dict) -> float:
    """One launch of ``point["kernel"]``."""
    return latency.kernel_time(gpu, consts, point["kernel"]).seconds * 1e6


def _consts(x, base: latency.Constants) -> latency.Constants:
    return latency.Constants(**(base.__dict__ | {n: float(math.exp(v)) for n, v in zip(latency.NAMES, x)}))


def fit(gpu: GPU, points: list[dict], start: latency.Constants = latency.Constants(),
        kernel_points: list[dict] = (), starts: int = 3) -> latency.Constants:
    """The constants minimising the squared log errors of the measured totals (``points``) and
    of the measured kernels (``kernel_points``), each set weighing the same, each constant
    inside its range."""
    from scipy.optimize import least_squares    # xgboost's dependency; only fitting needs it

    lo = [math.log(latency.RANGES[n][0]) for n in latency.NAMES]
    hi = [math.log(latency.RANGES[n][1]) for n in latency.NAMES]
    x0 = np.clip([math.log(getattr(start, n)) for n in latency.NAMES], lo, hi)
    weight = math.sqrt(len(points) / len(kernel_points)) if points and kernel_points else 1.0
    base = latency.Constants(**{k: v for k, v in start.__dict__.items() if k not in latency.NAMES})

    def residuals(x):
        c = _consts(x, base)
        return ([math.log(predict_ms(gpu, c, p) / p["measured_ms"]) for p in points]
                + [weight * math.log(predict_kernel_us(gpu, c, p) / p["measured_us"]) for p in kernel_points])

    best = None
    # a few starts: the max() terms make the surface piecewise, and one start can stall on a kink
    for scale in (1.0, 0.5, 2.0)[:starts]:
        x = np.clip(np.asarray(x0) + math.log(scale), lo, hi)
        r = least_squares(residuals, x, bounds=(lo, hi), diff_step=1e-3)
        if best is None or r.cost < best.cost:
            best = r
    return _consts(best.x, base)


def median_error(gpu: GPU, consts: latency.Constants, points: list[dict], kernel_points: list[dict] = ()) -> float:
    """The median |predicted / measured - 1| over the totals and kernels together."""
    errs = ([abs(predict_ms(gpu, consts, p) / p["measured_ms"] - 1) for p in points]
            + [abs(predict_kernel_us(gpu, consts, p) / p["measured_us"] - 1) for p in kernel_points])
    return statistics.median(errs) if errs else float("nan")
