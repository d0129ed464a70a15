"""One-line progress on stderr for the long steps of a compile (import, pipeline, build, nvcc,
ptxas feedback rounds). Silent unless enabled: the CLI turns it on, the Python API leaves it
off so notebooks and library users see only what they print.

On a terminal each step overwrites the previous line (``\\r``); elsewhere (logs, CI, a
subprocess) each step is its own line, so the output stays readable when captured.
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from typing import Iterator, TextIO

_stream: TextIO | None = None
_t0 = 0.0


def enable(stream: TextIO | None = None) -> None:
    """Show progress on ``stream`` (default stderr) from now on."""
    global _stream, _t0
    _stream, _t0 = stream or sys.stderr, time.perf_counter()


def disable() -> None:
    """Stop showing progress (the line in progress is ended first)."""
    global _stream
    if _stream is not None and _stream.isatty():
        _stream.write("\n")
    _stream = None


def step(message: str, done: int | None = None, total: int | None = None) -> None:
    """Report that ``message`` is starting; ``done``/``total`` draw a bar for counted work."""
    if _stream is None:
        return
    bar = ""
    if total:
        filled = int(20 * (done or 0) / total)
        bar = f" [{'#' * filled}{'.' * (20 - filled)}] {done}/{total}"
    line = f"souffle-tvm: {time.perf_counter() - _t0:6.1f}s {message}{bar}"
    if _stream.isatty():
        _stream.write("\r\033[K" + line)
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
