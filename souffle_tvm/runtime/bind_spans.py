"""Which statements of a sequence the lock-step emulator runs per thread as a unit: a ``Bind``
and the statements after it that use its variable.

The emulator runs a block's statements in lock step, each statement for all threads before the
next. A ``Bind``'s value is per thread (the stitcher binds a dual channel's value once and stores
it twice, ``stitch.channel``), so run alone it would leave one thread's value for all. Where the
span holds no barrier and allocates nothing (what lock step must see), it runs per thread whole.
"""

from __future__ import annotations

from tvm import tirx

from ..stitch.kernel_ir import BARRIERS, calls_to
from ..te.rewrite import uses


def spans(seq: list) -> list[tuple[list, bool]]:
    """``seq`` cut into (statements, whether they run per thread as one unit); the others are
    single statements, run in lock step."""
    out, i = [], 0
    while i < len(seq):
        j = i
        if isinstance(seq[i], tirx.Bind):
            j = max(k for k in range(i, len(seq)) if k == i or uses(seq[k], [seq[i].var]))
        span = seq[i:j + 1]
        whole = j > i and not any(isinstance(s, tirx.AllocBuffer) or calls_to(s, BARRIERS) for s in span)
        out += [(span, True)] if whole else [([s], False) for s in span]
        i = j + 1
    return out
