"""What the latency model prices with during one compile: by default the fitted constants and
the kernel times shipped with the package; on a device whose timing cache holds its own
(``souffle-tvm fit``'s constants, the kernels measured there), those. The driver sets it for the
length of a compile (``using``); the partitioner and the report read it (``current``)."""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

from .latency import FITTED, Constants
from .measured import MeasuredTimes


@dataclass(frozen=True)
class Prior:
    constants: Constants
    measured: MeasuredTimes
    source: str          # where the constants come from, for the report


_current: contextvars.ContextVar[Prior | None] = contextvars.ContextVar("souffle_tvm_prior", default=None)


def current() -> Prior:
    """The prior in force: the one set by ``using``, else the fitted constants and shipped times."""
    return _current.get() or Prior(FITTED, MeasuredTimes.load(), "fitted")


@contextlib.contextmanager
def using(prior: Prior | None):
    """``prior`` in force inside the block (None: whatever is in force already)."""
    token = _current.set(prior or _current.get())
    try:
        yield prior
    finally:
        _current.reset(token)
