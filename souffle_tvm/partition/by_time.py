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
from ..core.geometry import STITCH_BLOCK
from . import block_choice
from .groups import Group
from .subprograms import MAX_GROUPS_PER_SUBPROGRAM, MAX_STATEMENTS_PER_SUBPROGRAM, GroupFacts
from ..cost.work import Stage


def producers_of(groups: list[Group], readers: dict) -> list[set[int]]:
    """Per group, the earlier groups whose outputs it reads."""
    owner = {m.op: i for i, g in enumerate(groups) for m in g.members}
    for i, g in enumerate(groups):
        if g.opaque is not None:
            for t in g.opaque.outputs:
                owner[t.op] = i
    out: list[set[int]] = [set() for _ in groups]
    for op, i in owner.items():
        for r in readers.get(op, ()):
            j = owner.get(r)
            if j is not None and j != i:
                out[j].add(i)
    return out


def alone_seconds(gpu: hardware.GPU, c: latency.Constants, work: list[Stage],
                  estimates: list[estimate.Estimate]) -> float:
    """Stages, each a kernel of its own (with its static resource estimate) in a CUDA graph."""
    return sum(latency.kernel_time(gpu, c, latency.Kernel("g", st.tiles, st.threads, est.registers,
                                                          est.shared_bytes, (st,))).seconds + c.node_us * 1e-6
               for st, est in zip(work, estimates))


class Timer:
    """Predicted seconds of groups as separate kernels and of windows stitched into one."""

    def __init__(self, facts: GroupFacts, gpu: hardware.GPU, constants: latency.Constants,
                 block: int = STITCH_BLOCK, measured: MeasuredTimes | None = None):
        self.facts, self.gpu, self.c, self.block = facts, gpu, constants, block
        self.measured = measured or MeasuredTimes()
        self.node = constants.node_us * 1e-6
        self._stage: dict[tuple[int, int, int, bool], float] = {}
        self._group: dict[tuple[int, int, bool], float] = {}
        self._slots: dict[tuple[int, int, int], int] = {}
        self._resources: dict[int, tuple[int, int, bool, int]] = {}
        self._over: dict[tuple, str | None] = {}
        # group -> predicted seconds of another schedule it gets when left alone (v2's, where the
        # model predicts it faster than the stitchable one): what a boundary around it then costs
        self.rescheduled: dict[int, float] = {}
        self._syncing: tuple | None = None     # (producers, the same less the block-local ones)

    def separate(self, g: int) -> float:
        """Group ``g`` as kernels of their own in a CUDA graph, as it will be built: a time measured
        on the GPU for the same kernel (``cost.measured``) wins over the model's, and the model's
        is the faster of its stitchable schedule and the one it gets alone (``rescheduled``)."""
        keys = self.facts.kernel_keys
        known = self.measured.seconds(keys[g] if g < len(keys) else None)
        if known is not None:
            return known + self.node
        return min(self.stitchable_alone(g), self.rescheduled.get(g, float("inf")))

    def stitchable_alone(self, g: int) -> float:
        """Group ``g``'s stitchable schedule (256 threads), each stage a kernel of its own."""
        built = self.facts.alone_work
        return self.alone(built[g] if g < len(built) and built[g] else self.facts.work[g], self.facts.stages[g])

    def alone(self, work: list[Stage], estimates: list[estimate.Estimate]) -> float:
        """Stages, each a kernel of its own (with its static resource estimate) in a CUDA graph."""
        return alone_seconds(self.gpu, self.c, work, estimates)

    def stage(self, g: int, s: int, slots: int, persistent: bool) -> float:
        """Stage ``s`` of group ``g`` on ``slots`` resident blocks (``persistent``: in a stitched
        kernel, where a block starts its next tile only after its last)."""
        key = (g, s, slots, persistent)
        if key not in self._stage:
            self._stage[key] = latency.stage_time(self.gpu, self.c, self.facts.work[g][s], slots, persistent).seconds
        return self._stage[key]

    def stages(self, g: int, slots: int, persistent: bool) -> float:
        """All of group ``g``'s stages on ``slots`` resident blocks."""
        key = (g, slots, persistent)
        if key not in self._group:
            self._group[key] = sum(self.stage(g, s, slots, persistent) for s in range(len(self.facts.work[g])))
        return self._group[key]

    def syncing(self, producers: list[set[int]]) -> list[set[int]]:
        """Per group, the producers it needs a grid sync after when both are in a window: all but
        those the stitcher proves it reads block-locally (``GroupFacts.local_producers``: the same
        block wrote what it reads, so a block barrier orders them)."""
        local = self.facts.local_producers
        if not local:
            return producers
        if self._syncing is None or self._syncing[0] is not producers:
            self._syncing = (producers, [p - local[g] if g < len(local) else p for g, p in enumerate(producers)])
        return self._syncing[1]

    def credit(self, g: int) -> tuple[int, int] | None:
        """(producer, bytes): group ``g`` reads that many bytes on chip when stitched with it."""
        onchip = self.facts.onchip
        return onchip[g] if g < len(onchip) else None

    def stages_onchip(self, g: int, slots: int) -> float:
        """Group ``g``'s stages in a stitched kernel with its credited producer: the bytes it reads
        on chip (``credit``) taken off its first stage, which carries the group's bytes (and its
        global sectors in proportion, as the report prices the built kernel's stage)."""
        key = (g, slots, "onchip")
        if key not in self._group:
            credit = self.credit(g)
            work = self.facts.work[g]
            if credit is None or not work:
                return self.stages(g, slots, True)
            first = work[0].read_on_chip(credit[1])
            self._group[key] = (latency.stage_time(self.gpu, self.c, first, slots, True).seconds
                                + sum(self.stage(g, s, slots, True) for s in range(1, len(work))))
        return self._group[key]

    def member_seconds(self, g: int, slots: int, persistent: bool, start: int) -> float:
        """Group ``g`` as a member of a window that starts at group ``start``."""
        credit = self.credit(g) if persistent else None
        if credit is not None and credit[0] >= start:
            return self.stages_onchip(g, slots)
        return self.stages(g, slots, persistent)

    def slots(self, registers: int, shared: int, max_tiles: int) -> int:
        key = (registers, shared, max_tiles)
        if key not in self._slots:
            per_sm = max(hardware.occupancy(self.gpu, self.block, registers, shared).blocks_per_sm, 1)
            self._slots[key] = max(1, min(per_sm * self.gpu.sms, max_tiles))
        return self._slots[key]

    def resources(self, g: int) -> tuple[int, int, bool, int]:
        """Group ``g``'s most registers and shared memory over its stages, whether any spills,
        and its most tiles: all a window needs of it, whatever the window."""
        if g not in self._resources:
            facts = self.facts
            self._resources[g] = (max((e.registers for e in facts.stages[g]), default=0),
                                  max((e.shared_bytes for e in facts.stages[g]), default=0),
                                  any(e.spills for e in facts.stages[g]),
                                  max((st.tiles for st in facts.work[g]), default=0))
        return self._resources[g]

    def why_over(self, spills: bool, regs: int, registers: int, shared: int) -> str | None:
        key = (spills, regs, registers, shared)
        if key not in self._over:
            self._over[key] = self._why_over(*key)
        return self._over[key]

    def _why_over(self, spills: bool, regs: int, registers: int, shared: int) -> str | None:
        if spills or regs + estimate.STITCH_REGISTERS > estimate.MAX_REGISTERS:
            return f"registers: more than {estimate.MAX_REGISTERS} per thread (estimated), ptxas would spill"
        occ = hardware.occupancy(self.gpu, self.block, registers, shared)
        if occ.blocks_per_sm < 1:
            return (f"{occ.limited_by}: {registers} registers, {shared} B shared memory per block "
                    f"(estimated) leave no block of {self.block} threads co-resident on an SM")
        return None


class Window:
    """A window ``i..j`` grown one group at a time, its stitched time kept up to date.

    The reference for ``_Sweep``, which prices the same windows in array passes; the reasons'
    figures regrow the few windows they name. An addition reads only per-group figures the
    timer keeps (``resources``, ``stages``)."""

    def __init__(self, timer: Timer, producers: list[set[int]], i: int):
        self.t, self.producers, self.i = timer, timer.syncing(producers), i
        self.members: list[int] = []
        self.regs = self.shared = self.tiles = 0
        self.spills = False
        self.syncs = 0
        self.since_sync: set[int] = set()
        self.slots = 0
        self.persistent = False
        self.work = 0.0

    def add(self, g: int) -> None:
        t = self.t
        regs, shared, spills, tiles = t.resources(g)
        self.regs, self.shared = max(self.regs, regs), max(self.shared, shared)
        self.spills |= spills
        self.tiles = max(self.tiles, tiles)
        if self.members and not self.producers[g].isdisjoint(self.since_sync):
            self.syncs += 1
            self.since_sync = set()
        self.syncs += max(len(t.facts.work[g]) - 1, 0)      # a group's own launch regions
        self.since_sync.add(g)
        self.members.append(g)
        slots = t.slots(self.registers, self.shared, self.tiles)
        persistent = len(self.members) > 1      # one group alone is a kernel of its own
        if slots != self.slots or persistent != self.persistent:
            self.slots, self.persistent = slots, persistent
            self.work = sum(t.member_seconds(m, slots, persistent, self.i) for m in self.members)
        else:
            self.work += t.member_seconds(g, slots, persistent, self.i)

    @property
    def registers(self) -> int:
        return min(self.regs + (estimate.STITCH_REGISTERS if len(self.members) > 1 else 0), estimate.MAX_REGISTERS)

    def over_budget(self) -> str | None:
        return self.t.why_over(self.spills, self.regs, self.registers, self.shared)

    def seconds(self) -> float:
        return self.work + self.syncs * self.t.c.sync_us * 1e-6 + self.t.node


def window_seconds(timer: Timer, producers: list[set[int]], members: list[int]) -> float | None:
    """``members`` (consecutive groups) stitched into one kernel at ``timer.block`` threads, in a
    CUDA graph; None where a group cannot be stitched at that size or the kernel would break a
    resource limit (the static estimate)."""
    if any(timer.facts.unstitchable[g] is not None or not timer.facts.work[g] for g in members):
        return None
    w = Window(timer, producers, members[0])
    for g in members:
        w.add(g)
    return None if w.over_budget() is not None else w.seconds()


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
