"""One-line progress on stderr for the long steps of a compile (import, pipeline, build, nvcc,
ptxas feedback rounds). Silent unless enabled: the CLI turns it on when stderr is a terminal
(or ``SOUFFLE_TVM_PROGRESS=1``), the Python API leaves it off so notebooks, scripts and
library users see only what they print.

On a terminal each step overwrites the previous line (``\\r``) and the line is erased before
anything else is printed (:func:`clear`); elsewhere (``SOUFFLE_TVM_PROGRESS=1`` into a log)
each step is its own line.
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from typing import Iterator, TextIO

_stream: TextIO | None = None
_t0 = 0.0
_pending = False   # a terminal line is showing and must be erased before other output
ENV = "SOUFFLE_TVM_PROGRESS"


def wanted(stream: TextIO | None = None) -> bool:
    """Whether the CLI should show progress: ``SOUFFLE_TVM_PROGRESS`` (1/0) decides if set,
    else whether ``stream`` (stderr) is a terminal."""
    flag = os.environ.get(ENV)
    if flag is not None:
        return flag not in ("", "0")
    return (stream or sys.stderr).isatty()


def enable(stream: TextIO | None = None) -> None:
    """Show progress on ``stream`` (default stderr) from now on."""
    global _stream, _t0
    _stream, _t0 = stream or sys.stderr, time.perf_counter()


def clear() -> None:
    """Erase the progress line on a terminal, so that what is printed next starts clean."""
    global _pending
    if _stream is not None and _pending:
        _stream.write("\r\033[K")
        _stream.flush()
    _pending = False


def disable() -> None:
    """Stop showing progress (the line in progress is erased first)."""
    global _stream
    clear()
    _stream = None


def step(message: str, done: int | None = None, total: int | None = None) -> None:
    """Report that ``message`` is starting; ``done``/``total`` draw a bar for counted work."""
    global _pending
    if _stream is None:
        return
    bar = ""
    if total:
        filled = int(20 * (done or 0) / total)
        bar = f" [{'#' * filled}{'.' * (20 - filled)}] {done}/{total}"
    line = f"souffle-tvm: {time.perf_counter() - _t0:6.1f}s {message}{bar}"
    if _stream.isatty():
        _stream.write("\r\033[K" + line)
        _pending = True
    else:
        _stream.write(line + "\n")
    _stream.flush()


@contextmanager
def enabled(stream: TextIO | None = None) -> Iterator[None]:
    """``with progress.enabled(): ...`` shows progress for the block only."""
    enable(stream)
    try:
        yield
    finally:
        disable()
