"""Groups at every stitched block size, asked of the code generator for the partitioner
(``partition.block_choice``, ``partition.by_time``): each group scheduled again at each of
``STITCH_BLOCKS`` threads, lowered and priced; then each stitched subprogram's size, for the
stitcher."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import tvm
from tvm import tirx

from ..codegen.schedule import STITCH_BLOCK_ONLY_RULES
from ..core.geometry import STITCH_BLOCK, STITCH_BLOCKS
from ..core.ir_names import SOURCE_ATTR
from ..errors import ScheduleError, StitchError
from ..partition import block_choice
from ..partition.window_prices import Timer, window_seconds
from ..partition.groups import Group
from ..partition.subprograms import estimated_grid
from ..stitch.module import kernel_name
from .group_calls import GroupCalls
from .group_facts import group_facts
from .schedules import ScheduleCache, default_schedule


@dataclass
class AtSizes:
    """The groups priced at each block size: ``timers[STITCH_BLOCK]`` is the partition's; at
    another size a group some rule schedules at ``STITCH_BLOCK`` only is unstitchable, with why."""

    timers: dict[int, Timer]
    funcs: dict[int, dict[int, tirx.PrimFunc]] = field(default_factory=dict)   # size -> group -> its schedule
    members: frozenset = frozenset()      # the groups asked

    def others(self) -> dict[int, Timer]:
        return {b: t for b, t in self.timers.items() if b != STITCH_BLOCK}

    def with_timer(self, timer: Timer) -> "AtSizes":
        """The same, with ``timer`` as the partition's (a restitch makes a new one)."""
        return dataclasses.replace(self, timers={**self.timers, STITCH_BLOCK: timer})


@dataclass
class StitchedBlocks:
    """What the stitcher needs of the subprograms that take another block size."""

    # kernel name -> (threads per block, {stage PrimFunc name: its schedule at that size})
    blocks: dict[str, tuple[int, dict[str, tirx.PrimFunc]]] = field(default_factory=dict)
    grids: dict[str, int] = field(default_factory=dict)   # kernel name -> first grid (static estimate)
    why: dict[int, str] = field(default_factory=dict)      # subprogram -> the choice, with both figures


def _partition_rule(func: tirx.PrimFunc, raw: tirx.PrimFunc, target) -> str:
    """The rule that scheduled a stage at ``STITCH_BLOCK`` (memoised: the partition asked it)."""
    if func.attrs is not None and SOURCE_ATTR in func.attrs and str(func.attrs[SOURCE_ATTR]) == "database":
        return "database"
    return default_schedule(raw, target, STITCH_BLOCK).rule


def at_sizes(mod: tvm.IRModule, unscheduled: tvm.IRModule, groups: list[Group], target: tvm.target.Target,
             timer: Timer, members: set[int] | None = None, asked: AtSizes | None = None,
             sizes: tuple[int, ...] = STITCH_BLOCKS, gemm_k_tile: int | None = None) -> AtSizes:
    """``members`` (default: every group that can be stitched at ``STITCH_BLOCK``) scheduled
    at each other size of ``STITCH_BLOCKS``, their facts read and a ``Timer`` made for each
    size (``timer``: the partition's). ``mod``: the groups scheduled at ``STITCH_BLOCK``;
    ``unscheduled``: the same before scheduling. ``asked``: the answer for the same groups
    earlier (a ptxas-feedback restitch), reused where it holds ``members``. ``sizes``: the
    block sizes to price (``STITCH_BLOCK`` always). ``gemm_k_tile``: the stitched GEMMs' K tile
    where the user fixed it (``Options.gemm_k_tile``; None: chosen per GEMM)."""
    calls, raw = GroupCalls(mod, groups), GroupCalls(unscheduled, groups)
    if members is None:
        members = {i for i in calls.call_index if timer.facts.unstitchable[i] is None}
    if asked is not None and set(members) <= asked.members:
        return asked.with_timer(timer)
    only = {i: _partition_rule(calls.func(i), raw.func(i), target) for i in sorted(members)}
    only = {i: rule for i, rule in only.items() if rule in STITCH_BLOCK_ONLY_RULES}
    out = AtSizes({STITCH_BLOCK: timer}, members=frozenset(members))
    for size in sizes:
        if size == STITCH_BLOCK or not members:
            continue
        cache = ScheduleCache(target, size, gemm_k_tile)
        at_size = tvm.IRModule(dict(mod.functions), attrs=mod.attrs)
        funcs, why = {}, {i: f"{rule} schedules it at {STITCH_BLOCK} threads only" for i, rule in only.items()}
        for i in sorted(members - set(only)):
            try:
                funcs[i] = cache(raw.func(i)).func
            except ScheduleError as err:
                why[i] = f"no rule schedules it at {size} threads: {err}"
                continue
            at_size.update_func(calls.calls[calls.call_index[i]].args[0], funcs[i])
        try:
            facts = group_facts(GroupCalls(at_size, groups), target, block=size, unscheduled=unscheduled,
                                only=set(funcs))
        except StitchError:       # a stage at this size the stitcher cannot read: the size is not offered
            continue
        for i, reason in why.items():
            facts.unstitchable[i] = reason
        out.timers[size] = Timer(facts, timer.gpu, timer.c, block=size)
        out.funcs[size] = funcs
    return out


def faster_alone(at: AtSizes, alone: dict[int, tirx.PrimFunc]) -> None:
    """Groups whose schedule at another size is predicted faster as kernels of their own than
    the one they have alone (``alone``, v2's where ``policies.schedules_alone`` found it faster,
    else the stitchable one) take it, in ``alone`` and in the partition's timer: a boundary
    around a group is priced at the best it can be built as, so stitching is chosen where
    stitching pays, not where only a stitched kernel had the larger tile."""
    timer = at.timers[STITCH_BLOCK]
    for size, other in at.others().items():
        for i, func in at.funcs[size].items():
            if other.facts.unstitchable[i] is not None or not other.facts.work[i]:
                continue
            seconds = other.stitchable_alone(i)
            if seconds < timer.separate(i):
                alone[i], timer.rescheduled[i] = func, seconds


def block_sizes(at: AtSizes, mod: tvm.IRModule, groups: list[Group], subprograms: list[tuple[list[int], str]],
                producers: list[set[int]], keep: frozenset = frozenset()) -> StitchedBlocks:
    """Each stitched subprogram's block size (``partition.block_choice.choose`` on ``at``'s
    timers; ``mod``: the groups scheduled at ``STITCH_BLOCK``): those in ``keep`` (group
    positions as tuples: ptxas found them over budget at the size chosen) stay at
    ``STITCH_BLOCK``, and so does every piece a later split cuts from them (choosing the larger
    block again for a piece would undo the resize each split round, until the rounds run out)."""
    out = StitchedBlocks()
    calls = GroupCalls(mod, groups)
    kept = [set(t) for t in keep]
    for k, (idx, _) in enumerate(subprograms):
        if len(idx) < 2 or any(set(idx) <= t for t in kept):
            continue
        choice = block_choice.choose({b: window_seconds(t, producers, idx) for b, t in at.timers.items()})
        if choice is None:
            continue
        name = kernel_name(k)
        gv = {i: calls.calls[calls.call_index[i]].args[0].name_hint for i in idx}
        out.blocks[name] = (choice.block, {gv[i]: at.funcs[choice.block][i] for i in idx})
        out.grids[name] = estimated_grid(at.timers[choice.block].facts, idx, at.timers[choice.block].gpu,
                                         choice.block)
        out.why[k] = choice.why
    return out
