"""What a group, or a window of groups stitched into one kernel, costs: the time-driven
partitioner's prices (``by_time``), and the block-size choice's (``block_choice``).

``Timer`` holds the latency model's view of every group at one block size (its stages alone
and stitched, its resources, its on-chip credit, what was measured of it); ``Window`` prices a
window grown one group at a time (its resource limits, grid syncs and on-chip reads), and
``window_seconds`` one window whole. Nothing here draws a boundary.
"""

from __future__ import annotations

from ..cost import estimate, hardware, latency
from ..cost.measured import MeasuredTimes
from ..core.geometry import STITCH_BLOCK
from .groups import Group
from .subprograms import GroupFacts
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
