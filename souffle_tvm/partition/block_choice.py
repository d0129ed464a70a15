"""One block size per stitched subprogram: the one the latency model predicts fastest.

The partition is drawn at ``STITCH_BLOCK`` threads. Each stitched subprogram may then take
another of ``STITCH_BLOCKS``, its stages scheduled again at that size: fewer threads per block
let more blocks be resident, so a stage of many one-block tiles (a row reduction, a depthwise
convolution) runs in fewer waves, each paying its round trip; more threads give a stage of
few tiles more warps to hide its loads behind. Which wins depends on every stage of the
kernel and on the worst stage's registers, imposed on all; the model prices the whole window
at each size (``window_prices.window_seconds``, the partitioner's own pricing) and the fastest is
kept. The time-driven partitioner prices every window so (``by_time(sizes=...)``): where a
window is faster at another size, that size can draw its boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..core.geometry import STITCH_BLOCK


# The sizes the time partitioner prices every window at (the default's compile): 128 as well
# moved the zoo's predicted times by 0.0-1.3% (Swin 2.129 against 2.158 ms, BERT 2.299 against
# 2.311, EfficientNet 0.3492 against 0.3499) for 10-15% more compile time. The budget
# partitioner's few stitched subprograms are offered all of ``STITCH_BLOCKS``.
TIME_BLOCKS = (256, 512)

# A block size other than the partitioner's must be predicted at least this much faster: below
# it the difference is inside the model's error and the stitched form the partition was priced
# at is kept.
MIN_GAIN = 0.02


@dataclass(frozen=True)
class BlockChoice:
    """A stitched subprogram's block size and why, with both predicted times (estimates)."""

    block: int
    seconds: float            # the kernel at ``block``
    partitioner_seconds: float | None  # the kernel at ``STITCH_BLOCK`` (None: it breaks a limit there)
    why: str


def fastest(seconds: dict[int, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Per window, the time at the block size ``choose`` would take, and that size: ``seconds``
    maps each size to its windows' times (windows i..i+1, i..i+2, ... from one start, as far as
    that size lets the window grow; ``STITCH_BLOCK``'s included). A window priced at no size
    gets inf. What the time partitioner minimises, so its boundaries and ``choose`` agree."""
    length = max(len(t) for t in seconds.values())

    def padded(t):
        return np.concatenate((t, np.full(length - len(t), np.inf)))

    base = padded(seconds.get(STITCH_BLOCK, np.zeros(0)))
    best, size = base.copy(), np.full(length, STITCH_BLOCK)
    for block in sorted(seconds):
        if block == STITCH_BLOCK:
            continue
        t = padded(seconds[block])
        # another size where it is MIN_GAIN faster than the partition's, or the only one priced,
        # and faster than any other taken so far
        better = np.where(np.isinf(base), t < best, (t <= base * (1 - MIN_GAIN)) & (t < best))
        best, size = np.where(better, t, best), np.where(better, block, size)
    return best, size


def choose(priced: dict[int, float | None]) -> BlockChoice | None:
    """The block size for a stitched subprogram priced at each size (``priced``: seconds, None
    where it cannot be stitched at that size; ``STITCH_BLOCK``'s as partitioned), as
    ``fastest`` takes it. None where the partition's block size stays."""
    seconds = {block: np.array([t]) for block, t in priced.items() if t is not None}
    if not seconds:
        return None
    best, size = fastest(seconds)
    block, t = int(size[0]), float(best[0])
    if block == STITCH_BLOCK or np.isinf(t):
        return None
    base = priced.get(STITCH_BLOCK)
    than = f"{base * 1e6:.1f} us at {STITCH_BLOCK}" if base is not None else \
        f"no window at {STITCH_BLOCK} (a resource limit)"
    return BlockChoice(block, t, base, f"{block} threads per block: predicted {t * 1e6:.1f} us against {than} "
                                       "(estimates)")
