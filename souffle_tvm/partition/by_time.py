"""Time-driven subprograms: stitch consecutive groups only where the latency model predicts ONE
cooperative kernel faster than the same groups as separate kernels under a CUDA graph.

A dynamic programme over the groups in order: every window ``i..j`` that may be stitched (all
stitchable, no forced cut inside, within the compile-time budget and the static resource
estimate) costs its stitched kernel's predicted time; a single group costs its own kernels'.
The partition minimises the sum. Launch count is a result, not a target: stretches of small
stages (an LSTM's steps, MMoE's towers) stitch because syncs beat graph nodes there; large
GEMMs and convolutions whose tiles fill the GPU alone stay separate when the stitched kernel's
worst-stage occupancy, its one-wave grid or its syncs would cost more.

Every boundary keeps a reason; a time boundary gives both figures.
"""

from __future__ import annotations


import numpy as np

from ..cost import estimate, hardware, latency
from ..cost.measured import MeasuredTimes
from . import block_choice
from .groups import Group
from .subprograms import MAX_GROUPS_PER_SUBPROGRAM, MAX_STATEMENTS_PER_SUBPROGRAM, GroupFacts
from .window_prices import Timer, Window, producers_of


class _Sweep:
    """Every window from one start priced at once, with the figures ``Window`` gives when grown
    one group at a time (the same sums in the same order). The partitioner prices ~n^2/2
    windows (the full LSTM's rolled steps: 4.4M), so per start it makes a few array passes
    instead of one Python step per window."""

    def __init__(self, timer: Timer, producers: list[set[int]], forced: dict[int, str], unstitchable: list,
                 rep: list, size: list[int], max_groups: int, max_statements: int, names: list[str]):
        n = len(unstitchable)
        self.t, self.n, self.forced, self.unstitchable, self.names = timer, n, forced, unstitchable, names
        self.max_groups, self.max_statements = max_groups, max_statements
        res = [timer.resources(g) if unstitchable[g] is None else (0, 0, False, 0) for g in range(n)]
        self.regs, self.shared = np.array([r[0] for r in res]), np.array([r[1] for r in res])
        self.spills, self.tiles = np.array([r[2] for r in res]), np.array([r[3] for r in res])
        self.own = np.array([max(len(timer.facts.work[g]) - 1, 0) if unstitchable[g] is None else 0
                             for g in range(n)])
        self.rep = np.array([-1 if r is None else r for r in rep])
        self.size = np.array(size)
        # where growth must stop after group j: the model's end, a forced cut, an unstitchable next group
        self.barrier = np.array([j + 1 >= n or j in forced or unstitchable[j + 1] is not None for j in range(n)])
        # A window needs a grid sync before group g when g reads a member since the last sync; the
        # members since it are consecutive, so that is: g's latest earlier producer is at or after
        # the group that followed the last sync. next_sync[p]: the first such g after a sync at p.
        producers = timer.syncing(producers)
        last = np.array([max((q for q in producers[g] if q < g), default=-1) for g in range(n)])
        self.next_sync = [p + 1 + int(np.argmax(last[p + 1:] >= p)) if (last[p + 1:] >= p).any() else n
                          for p in range(n)]
        self._per_slots: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        # per group, the producer it reads on chip when stitched with it (-1: none)
        self.credit_from = np.array([(timer.credit(g) or (-1, 0))[0] for g in range(n)])

    def _stage_seconds(self, slots: int, start: int) -> np.ndarray:
        """Every group's stages on ``slots`` resident blocks of a stitched kernel that starts at
        group ``start`` (a group whose credited producer is in it reads that on chip)."""
        if slots not in self._per_slots:
            full = np.array([self.t.stages(g, slots, True) if self.unstitchable[g] is None else 0.0
                             for g in range(self.n)])
            onchip = np.array([self.t.stages_onchip(g, slots) if self.unstitchable[g] is None else 0.0
                               for g in range(self.n)])
            self._per_slots[slots] = (full, onchip)
        full, onchip = self._per_slots[slots]
        return np.where(self.credit_from >= start, onchip, full)

    def windows(self, i: int, stop: dict) -> tuple[np.ndarray, np.ndarray]:
        """Every window i..j with j > i the partitioner may grow to: the j, and each one's stitched
        seconds; why it can grow no further goes into ``stop`` as ``Window``'s growth records it."""
        n, t = self.n, self.t
        ends = np.flatnonzero(self.barrier[i:])
        last = i + int(ends[0])                  # growth from ``last`` to last + 1 is barred
        k = np.arange(i + 1, last + 1)           # candidate new members
        if k.size:
            # the compile-time budget: rolled repeats are free
            free = self.rep[k] >= i
            count = 1 + np.cumsum(~free)
            used = self.size[i] + np.cumsum(np.where(free, 0, self.size[k]))
            over_budget = ~free & ((count > self.max_groups) | (used > self.max_statements))
            # the resource limits of the window i..k, stitched
            regs = np.maximum.accumulate(self.regs[i:last + 1])[1:]
            shared = np.maximum.accumulate(self.shared[i:last + 1])[1:]
            spills = np.logical_or.accumulate(self.spills[i:last + 1])[1:]
            tiles = np.maximum.accumulate(self.tiles[i:last + 1])[1:]
            registers = np.minimum(regs + estimate.STITCH_REGISTERS, estimate.MAX_REGISTERS)
            change = np.flatnonzero(np.diff(regs) | np.diff(shared) | np.diff(spills) | np.diff(tiles)) + 1
            runs = np.concatenate(([0], change, [k.size]))
            why = [None] * k.size
            slots = np.empty(k.size, dtype=np.int64)
            bad = np.zeros(k.size, dtype=bool)
            for a, b in zip(runs[:-1], runs[1:]):
                reason = t.why_over(bool(spills[a]), int(regs[a]), int(registers[a]), int(shared[a]))
                slots[a:b] = t.slots(int(registers[a]), int(shared[a]), int(tiles[a]))
                if reason is not None:
                    bad[a:b], why[a] = True, reason
            first_budget = int(np.argmax(over_budget)) if over_budget.any() else k.size
            first_bad = int(np.argmax(bad)) if bad.any() else k.size
            grown = min(first_budget, first_bad)        # windows i..k[:grown] are allowed
        else:
            grown = 0
        j = i + grown
        if grown < k.size:
            if grown == first_budget:
                stop[(i, j)] = (f"compile-time budget: {self.max_groups} groups or {self.max_statements} statements "
                                "per stitched kernel")
            else:
                stop[(i, j)] = f"adding {self.names[j + 1]} breaks a resource limit: {why[first_bad]}"
        elif j + 1 < n:
            stop[(i, j)] = self.forced[j] if j in self.forced else \
                f"next group is not stitchable: {self.unstitchable[j + 1]}"
        if grown == 0:
            return np.zeros(0, dtype=np.int64), np.zeros(0)
        k, slots = k[:grown], slots[:grown]
        # work: each window's members on its own slots, summed from i in order
        work = np.empty(grown)
        starts = np.concatenate(([0], np.flatnonzero(np.diff(slots)) + 1, [grown]))
        for a, b in zip(starts[:-1], starts[1:]):
            work[a:b] = np.cumsum(self._stage_seconds(int(slots[a]), i)[i:j + 1])[1 + a:1 + b]
        # grid syncs: each member's own launch regions, and one before each reader of a member since the last
        syncs = np.cumsum(self.own[i:j + 1])[1:]
        points, p = [], self.next_sync[i]
        while p <= j:
            points.append(p)
            p = self.next_sync[p]
        syncs = syncs + np.searchsorted(np.array(points, dtype=np.int64), k, side="right")
        return k, work + syncs * t.c.sync_us * 1e-6 + t.node


def by_time(groups: list[Group], facts: GroupFacts, gpu: hardware.GPU, readers: dict,
            forced: dict[int, str] | None = None, constants: latency.Constants = latency.FITTED,
            measured: MeasuredTimes | None = None, timer: Timer | None = None,
            max_statements: int = MAX_STATEMENTS_PER_SUBPROGRAM,
            max_groups: int = MAX_GROUPS_PER_SUBPROGRAM, sweep: bool = True,
            sizes: dict[int, Timer] | None = None) -> list[tuple[list[int], str]]:
    """The partition into subprograms that minimises predicted time (see the module doc).

    ``facts`` must carry ``work`` and ``stages`` (``planning.group_facts.group_facts``); ``forced``
    maps a group to the reason a boundary must follow it (ptxas feedback); ``measured``: GPU
    times that win over the model's (default: none); ``timer``: one already made (it caches stage
    times; the pipeline reuses it after partitioning); ``sweep``: price all windows from one
    start at once (``_Sweep``, the same figures; False: grow them one group at a time, the
    reference the tests hold it to); ``sizes``: the same groups priced at other block sizes
    (a ``Timer`` each, on facts of the groups scheduled at that size): a stitched window costs
    what it costs at the size ``block_choice.fastest`` takes, the size the stitcher then gives it
    (``block_choice.choose``). Returns (group indices, the reason for the boundary that ends the
    subprogram)."""
    forced = forced or {}
    n = len(groups)
    timer = timer or Timer(facts, gpu, constants, measured=measured)
    producers = producers_of(groups, readers)
    rep = facts.repeat_of or [None] * n
    size = facts.statements or [1] * n

    def unstitchable(i: int) -> str | None:
        g = groups[i]
        return f"opaque op ({g.opaque.reason})" if g.opaque is not None else facts.unstitchable[i]

    timers = {timer.block: timer, **(sizes or {})}

    def unstitchable_at(block: int, i: int) -> str | None:
        return unstitchable(i) if block == timer.block else unstitchable(i) or timers[block].facts.unstitchable[i]

    alone = [timer.separate(i) if groups[i].opaque is None and facts.work[i] else 0.0 for i in range(n)]
    stop: dict[tuple[int, int], str] = {}     # why window i..j cannot grow to j + 1 (at the partition's size)

    def grow(i: int, block: int | None = None, why: dict | None = None):
        """Window i..j stitched at ``block`` threads (default: the partition's), for j = i + 1,
        i + 2, ... while it may grow: (j, seconds); why it stops goes into ``why`` (default:
        ``stop``, the reasons' record)."""
        block = block or timer.block
        record = stop if why is None else why
        w = Window(timers[block], producers, i)
        w.add(i)
        used, count, j = size[i], 1, i
        while j + 1 < n:
            if j in forced:
                record[(i, j)] = forced[j]
                return
            nwhy = unstitchable_at(block, j + 1)
            if nwhy is not None:
                record[(i, j)] = f"next group is not stitchable: {nwhy}"
                return
            rolled = rep[j + 1] is not None and rep[j + 1] >= i
            if not rolled and (count + 1 > max_groups or used + size[j + 1] > max_statements):
                record[(i, j)] = (f"compile-time budget: {max_groups} groups or {max_statements} statements "
                                "per stitched kernel")
                return
            w.add(j + 1)
            over = w.over_budget()
            if over is not None:
                record[(i, j)] = f"adding {groups[j + 1].name} breaks a resource limit: {over}"
                return
            j += 1
            if not rolled:
                used, count = used + size[j], count + 1
            yield j, w.seconds()

    def seconds_from(i: int) -> np.ndarray:
        """Windows i..i+1, i..i+2, ...: each one's stitched seconds at the size it is built at."""
        per = {}
        for block in timers:
            if unstitchable_at(block, i) is not None:
                continue
            why = stop if block == timer.block else {}      # the reasons name the partition's size
            per[block] = (fast[block].windows(i, why)[1] if fast is not None else
                          np.array([t for _, t in grow(i, block, why)]))
        return per[timer.block] if len(per) == 1 else block_choice.fastest(per)[0]

    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    choice = [0] * (n + 1)
    stitched: dict[tuple[int, int], float] = {}     # (i, j) -> seconds, where window i..j improved best[j + 1]
    fast = {block: _Sweep(t, producers, forced, [unstitchable_at(block, i) for i in range(n)], rep, size,
                          max_groups, max_statements, [g.name for g in groups]) for block, t in timers.items()} \
        if sweep else None
    for i in range(n):
        if best[i] + alone[i] < best[i + 1]:
            best[i + 1], choice[i + 1] = best[i] + alone[i], i
        if unstitchable(i) is not None:
            continue
        seconds = seconds_from(i)
        ends = np.arange(i + 1, i + 1 + seconds.size, dtype=np.int64)
        total = best[i] + seconds
        better = total < best[ends + 1]
        for j, t, tt in zip(ends[better].tolist(), seconds[better].tolist(), total[better].tolist()):
            best[j + 1], choice[j + 1] = tt, i
            stitched[(i, j)] = t

    def window_time(i: int, k: int) -> float | None:
        """Window i..k stitched, None where it may not grow that far (a reason's figures)."""
        if (i, k) not in stitched:
            per = {block: np.array([next((t for j, t in grow(i, block, {}) if j == k), np.inf)])
                   for block in timers if unstitchable_at(block, i) is None}
            t = float(block_choice.fastest(per)[0][0]) if per else np.inf
            stitched[(i, k)] = None if np.isinf(t) else t
        return stitched[(i, k)]

    segments = []
    k = n
    while k > 0:
        segments.append(list(range(choice[k], k)))
        k = choice[k]
    segments.reverse()
    return [(seg, _reason(groups, seg, nxt, unstitchable, forced, stop, window_time, alone))
            for seg, nxt in zip(segments, segments[1:] + [None])]


def _reason(groups, seg, nxt, unstitchable, forced, stop, window_time, alone) -> str:
    i, k = seg[0], seg[-1]
    if nxt is None:
        return "end of model"
    if unstitchable(i) is not None:
        return f"not stitchable: {unstitchable(i)}"
    if (i, k) in stop:
        return stop[(i, k)]
    if k in forced:
        return forced[k]
    here = (window_time(i, k) if len(seg) > 1 else alone[i]) or 0.0
    after = (window_time(nxt[0], nxt[-1]) if len(nxt) > 1 else alone[nxt[0]]) or 0.0
    joined = window_time(i, nxt[-1])
    if joined is None:
        return f"time: joining {groups[nxt[0]].name} is not a window the budget allows"
    return (f"time: separate kernels predicted faster ({(here + after) * 1e6:.1f} us as "
            f"{'this kernel' if len(seg) > 1 else groups[i].name} then {groups[nxt[0]].name}"
            f"{'...' if len(nxt) > 1 else ''}, {joined * 1e6:.1f} us as one kernel)")
