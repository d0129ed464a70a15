"""Which groups ``rolling`` will roll, asked before any lowering: the test ``rolling.roll``
makes on a stitched kernel's stages, at the level of a subprogram's groups. With it the
partitioner counts a repeated group's code once, not once per iteration."""

from __future__ import annotations

from .rolling import MAX_PERIOD, MIN_TRIPS


def repeats(signatures: list, reads: list[list], min_trips: int = MIN_TRIPS,
            max_period: int = MAX_PERIOD) -> list[int | None]:
    """Per group, the earlier group it repeats inside a run ``roll`` would make a loop of (None
    if none). Group i repeats group i - p when both have the same skeleton (``signatures``) and
    each input is the same tensor as that group's, or is made by the group one period after
    that tensor's maker. ``reads[i]`` lists group i's inputs as ``("group", maker index,
    output)`` or ``("ext", key)``. Only whole iterations count: every group of ``min_trips``
    consecutive periods must repeat the period before (an EfficientNet block's weight-free
    stages repeat the previous block's, its convolutions do not: nothing there is a loop).
    The first iteration of a run repeats nothing."""
    n = len(signatures)

    def rep(i: int, p: int) -> bool:
        j = i - p
        if j < 0 or signatures[i] is None or signatures[j] != signatures[i] or len(reads[j]) != len(reads[i]):
            return False
        return all(x == y or (x[0] == y[0] == "group" and x[1] == y[1] + p and x[2] == y[2])
                   for x, y in zip(reads[i], reads[j]))

    out: list[int | None] = [None] * n
    s = 0
    while s < n:
        best = None
        for p in range(1, min(max_period, (n - s) // min_trips) + 1):
            count = 1       # iterations: the first, then each that repeats the one before
            while s + (count + 1) * p <= n and all(rep(s + count * p + q, p) for q in range(p)):
                count += 1
            if count >= min_trips and (best is None or count * p > best[0] * best[1]):
                best = (p, count)
        if best is None:
            s += 1
            continue
        p, count = best
        for i in range(s + p, s + count * p):
            out[i] = i - p
        s += count * p
    return out
