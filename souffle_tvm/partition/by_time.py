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


from ..core import estimate, hardware, latency
from ..core.measured import MeasuredTimes
from ..core.geometry import STITCH_BLOCK
from .groups import Group
from .subprograms import MAX_GROUPS_PER_SUBPROGRAM, MAX_STATEMENTS_PER_SUBPROGRAM, GroupFacts


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


class Timer:
    """Predicted seconds of groups as separate kernels and of windows stitched into one."""

    def __init__(self, facts: GroupFacts, gpu: hardware.GPU, constants: latency.Constants,
                 block: int = STITCH_BLOCK, measured: MeasuredTimes | None = None):
        self.facts, self.gpu, self.c, self.block = facts, gpu, constants, block
        self.measured = measured or MeasuredTimes()
        self.node = constants.node_us * 1e-6
        self._stage: dict[tuple[int, int, int], float] = {}
        # group -> predicted seconds of another schedule it gets when left alone (v2's, where the
        # model predicts it faster than the stitchable one): what a boundary around it then costs
        self.rescheduled: dict[int, float] = {}

    def separate(self, g: int) -> float:
        """Group ``g`` as kernels of their own in a CUDA graph, as it will be built: a time measured
        on the GPU for the same kernel (``core.measured``) wins over the model's, and the model's
        is the faster of its stitchable schedule and the one it gets alone (``rescheduled``)."""
        keys = self.facts.kernel_keys
        known = self.measured.seconds(keys[g] if g < len(keys) else None)
        if known is not None:
            return known + self.node
        return min(self.stitchable_alone(g), self.rescheduled.get(g, float("inf")))

    def stitchable_alone(self, g: int) -> float:
        """Group ``g``'s stitchable schedule (256 threads), each stage a kernel of its own."""
        return self.alone(self.facts.work[g], self.facts.stages[g])

    def alone(self, work: list[latency.Stage], estimates: list[estimate.Estimate]) -> float:
        """Stages, each a kernel of its own (with its static resource estimate) in a CUDA graph."""
        return sum(latency.kernel_time(self.gpu, self.c, latency.Kernel("g", st.tiles, st.threads, est.registers,
                                                                        est.shared_bytes, (st,))).seconds + self.node
                   for st, est in zip(work, estimates))

    def stage(self, g: int, s: int, slots: int, persistent: bool) -> float:
        """Stage ``s`` of group ``g`` on ``slots`` resident blocks (``persistent``: in a stitched
        kernel, where a block starts its next tile only after its last)."""
        key = (g, s, slots, persistent)
        if key not in self._stage:
            self._stage[key] = latency.stage_time(self.gpu, self.c, self.facts.work[g][s], slots, persistent).seconds
        return self._stage[key]

    def slots(self, registers: int, shared: int, max_tiles: int) -> int:
        per_sm = max(hardware.occupancy(self.gpu, self.block, registers, shared).blocks_per_sm, 1)
        return max(1, min(per_sm * self.gpu.sms, max_tiles))


class _Window:
    """A window ``i..j`` grown one group at a time, its stitched time kept up to date."""

    def __init__(self, timer: Timer, producers: list[set[int]], i: int):
        self.t, self.producers, self.i = timer, producers, i
        self.members: list[int] = []
        self.regs = self.shared = self.tiles = 0
        self.spills = False
        self.syncs = 0
        self.since_sync: set[int] = set()
        self.slots = 0
        self.persistent = False
        self.work = 0.0

    def add(self, g: int) -> None:
        facts = self.t.facts
        for est, st in zip(facts.stages[g], facts.work[g]):
            self.regs = max(self.regs, est.registers)
            self.shared = max(self.shared, est.shared_bytes)
            self.spills |= est.spills
            self.tiles = max(self.tiles, st.tiles)
        if self.members and self.producers[g] & self.since_sync:
            self.syncs += 1
            self.since_sync = set()
        self.syncs += max(len(facts.work[g]) - 1, 0)      # a group's own launch regions
        self.since_sync.add(g)
        self.members.append(g)
        slots = self.t.slots(self.registers, self.shared, self.tiles)
        persistent = len(self.members) > 1      # one group alone is a kernel of its own
        if (slots, persistent) != (self.slots, self.persistent):
            self.slots, self.persistent = slots, persistent
            self.work = sum(self.t.stage(m, s, slots, persistent) for m in self.members
                            for s in range(len(facts.work[m])))
        else:
            self.work += sum(self.t.stage(g, s, slots, persistent) for s in range(len(facts.work[g])))

    @property
    def registers(self) -> int:
        return min(self.regs + (estimate.STITCH_REGISTERS if len(self.members) > 1 else 0), estimate.MAX_REGISTERS)

    def over_budget(self) -> str | None:
        if self.spills or self.regs + estimate.STITCH_REGISTERS > estimate.MAX_REGISTERS:
            return f"registers: more than {estimate.MAX_REGISTERS} per thread (estimated), ptxas would spill"
        occ = hardware.occupancy(self.t.gpu, self.t.block, self.registers, self.shared)
        if occ.blocks_per_sm < 1:
            return (f"{occ.limited_by}: {self.registers} registers, {self.shared} B shared memory per block "
                    f"(estimated) leave no block of {self.t.block} threads co-resident on an SM")
        return None

    def seconds(self) -> float:
        return self.work + self.syncs * self.t.c.sync_us * 1e-6 + self.t.node


def by_time(groups: list[Group], facts: GroupFacts, gpu: hardware.GPU, readers: dict,
            forced: dict[int, str] | None = None, constants: latency.Constants = latency.FITTED,
            measured: MeasuredTimes | None = None, timer: Timer | None = None,
            max_statements: int = MAX_STATEMENTS_PER_SUBPROGRAM,
            max_groups: int = MAX_GROUPS_PER_SUBPROGRAM) -> list[tuple[list[int], str]]:
    """The partition into subprograms that minimises predicted time (see the module doc).

    ``facts`` must carry ``work`` and ``stages`` (``pipeline.policies.group_facts``); ``forced``
    maps a group to the reason a boundary must follow it (ptxas feedback); ``measured``: GPU
    times that win over the model's (default: none); ``timer``: one already made (it caches stage
    times; the pipeline reuses it after partitioning). Returns (group indices, the reason for
    the boundary that ends the subprogram)."""
    forced = forced or {}
    n = len(groups)
    timer = timer or Timer(facts, gpu, constants, measured=measured)
    producers = producers_of(groups, readers)
    rep = facts.repeat_of or [None] * n
    size = facts.statements or [1] * n

    def unstitchable(i: int) -> str | None:
        g = groups[i]
        return f"opaque op ({g.opaque.reason})" if g.opaque is not None else facts.unstitchable[i]

    alone = [timer.separate(i) if groups[i].opaque is None and facts.work[i] else 0.0 for i in range(n)]
    best = [0.0] + [float("inf")] * n
    choice = [0] * (n + 1)
    stitched: dict[tuple[int, int], float] = {}
    stop: dict[tuple[int, int], str] = {}     # why window i..j cannot grow to j + 1
    for i in range(n):
        if best[i] + alone[i] < best[i + 1]:
            best[i + 1], choice[i + 1] = best[i] + alone[i], i
        if unstitchable(i) is not None:
            continue
        w = _Window(timer, producers, i)
        w.add(i)
        used, count, j = size[i], 1, i
        while True:
            if j + 1 >= n:
                break
            if j in forced:
                stop[(i, j)] = forced[j]
                break
            nwhy = unstitchable(j + 1)
            if nwhy is not None:
                stop[(i, j)] = f"next group is not stitchable: {nwhy}"
                break
            rolled = rep[j + 1] is not None and rep[j + 1] >= i
            if not rolled and (count + 1 > max_groups or used + size[j + 1] > max_statements):
                stop[(i, j)] = (f"compile-time budget: {max_groups} groups or {max_statements} statements "
                                "per stitched kernel")
                break
            w.add(j + 1)
            over = w.over_budget()
            if over is not None:
                stop[(i, j)] = f"adding {groups[j + 1].name} breaks a resource limit: {over}"
                break
            j += 1
            if not rolled:
                used, count = used + size[j], count + 1
            t = w.seconds()
            stitched[(i, j)] = t
            if best[i] + t < best[j + 1]:
                best[j + 1], choice[j + 1] = best[i] + t, i
    segments = []
    k = n
    while k > 0:
        segments.append(list(range(choice[k], k)))
        k = choice[k]
    segments.reverse()
    return [(seg, _reason(groups, seg, nxt, unstitchable, forced, stop, stitched, alone))
            for seg, nxt in zip(segments, segments[1:] + [None])]


def _reason(groups, seg, nxt, unstitchable, forced, stop, stitched, alone) -> str:
    i, k = seg[0], seg[-1]
    if nxt is None:
        return "end of model"
    if unstitchable(i) is not None:
        return f"not stitchable: {unstitchable(i)}"
    if (i, k) in stop:
        return stop[(i, k)]
    if k in forced:
        return forced[k]
    here = (stitched.get((i, k)) if len(seg) > 1 else alone[i]) or 0.0
    after = (stitched.get((nxt[0], nxt[-1])) if len(nxt) > 1 else alone[nxt[0]]) or 0.0
    joined = stitched.get((i, nxt[-1]))
    if joined is None:
        return f"time: joining {groups[nxt[0]].name} is not a window the budget allows"
    return (f"time: separate kernels predicted faster ({(here + after) * 1e6:.1f} us as "
            f"{'this kernel' if len(seg) > 1 else groups[i].name} then {groups[nxt[0]].name}"
            f"{'...' if len(nxt) > 1 else ''}, {joined * 1e6:.1f} us as one kernel)")
