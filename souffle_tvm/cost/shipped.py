"""The latency model's data that ships inside the package (``souffle_tvm/cost/data/``), so that
an installed wheel reads nothing through the repository: the fitted constants with the
leave-one-model-out refits (``constants.json``, written by ``souffle_experiments fit`` beside
``data/latency/fit.json``) and the kernel times measured on GPUs elsewhere (``measured.json``,
written by ``souffle_experiments gpu-check record``)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from ..core.files import atomic_write
from .latency import Constants

DATA = Path(__file__).resolve().parent / "data"
CONSTANTS = DATA / "constants.json"
MEASURED = DATA / "measured.json"


@functools.cache
def _constants_file() -> dict:
    return json.loads(CONSTANTS.read_text())


def fitted() -> Constants:
    """The constants of the shipped fit (``latency.FITTED`` is checked to equal them)."""
    return Constants.fitted_from(_constants_file()["constants"])


def leave_one_model_out() -> dict[str, Constants]:
    """{model left out: the constants refitted without it}: the model's own spread, the sets a
    choice made without a device must hold under (``measure.regret``)."""
    return {m: Constants.fitted_from(c) for m, c in sorted(_constants_file()["lomo_constants"].items())}


def write(validation: dict, source: str) -> Path:
    """Write ``constants.json`` from a fit's validation (``souffle_experiments.latency_fit``)."""
    out = {k: validation[k] for k in ("gpu", "constants", "lomo_constants", "lomo_median_abs_error")}
    atomic_write(CONSTANTS, json.dumps(out | {"source": source}, indent=1, sort_keys=True) + "\n")
    _constants_file.cache_clear()
    return CONSTANTS
