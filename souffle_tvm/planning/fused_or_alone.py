"""Fused or alone: whether a group schedules as well as its parts, and which groups left as
kernels of their own take another schedule.

* ``why_not_fused``: whether a group schedules as well as its anchor alone (V2 schedule
  feedback; ``partition.kernels.split_unschedulable`` acts on it), and, on CUDA, whether the
  latency model predicts it slower as one kernel than as the groups it joined;
* ``schedules_alone`` / ``reschedule_alone``: the v2 schedule (the default rules' block size)
  for a group the partitioner leaves alone, where the model predicts it faster than the
  stitchable one.
"""

from __future__ import annotations

import tvm
from tvm import tirx

from ..codegen import schedule
from ..codegen.rules.gemm_tiles import block_count
from ..core.targets import is_cuda
from ..cost import estimate, hardware, latency
from ..errors import ScheduleError, StitchError
from ..partition import kernels, window_prices
from ..partition.groups import Group, outputs_of
from ..stitch import lower
from .block_counts import stage_work
from .group_calls import GroupCalls
from .schedules import ScheduleCache


def why_not_fused(cache: ScheduleCache, group: Group, outputs: list, readers: dict | None = None) -> str | None:
    """None when the group schedules as well as its anchor does alone; else why not.
    ``readers`` (op -> the ops that read it): also why not where fusing took the anchor's
    parallelism away and the latency model predicts the group slower as one kernel than
    without its last member (``slower_fused``)."""
    func, _ = cache.group_funcs(group, outputs)
    try:
        done = cache(func)
    except ScheduleError as err:
        return str(err)
    broken = breaks_join(group, done)
    if broken is not None:
        return broken
    anchor = group.anchor
    if anchor is None or len(group.members) == 1:
        return None
    alone, _ = cache.group_funcs(Group([anchor]), [anchor])
    try:
        anchor_done = cache(alone)
    except ScheduleError:
        return None
    anchor_rule = anchor_done.rule
    if schedule.RANK[done.rule] < schedule.RANK[anchor_rule]:
        # why the anchor's rule did not take the fused group, when it said so
        why = [n for n in done.notes if n.rule == anchor_rule]
        because = f" ({why[0]})" if why else ""
        return f"fused, dlight schedules it with {done.rule}{because}; the anchor alone gets {anchor_rule}"
    if readers is not None and is_cuda(cache.target) and \
            block_count(done.func) < block_count(anchor_done.func):
        return slower_fused(cache, group, func, readers)
    return None

def slower_fused(cache: ScheduleCache, group: Group, func: tirx.PrimFunc, readers: dict) -> str | None:
    """Why ``group`` (its PrimFunc ``func``) is predicted slower as one kernel than as the
    groups it would be without the rule that joined it (``kernels.parts_of``: all but its
    last member and that member; a row chain's three; a prologue or a window chain cut where
    it joined), each a kernel of its own in a CUDA graph (an
    estimate); None where it is not, or a form cannot be priced."""
    split = kernels.parts_of(group)
    whole = _scheduled_alone_seconds(cache, func)
    parts = [_scheduled_alone_seconds(cache, cache.group_funcs(g, outputs_of(g, readers))[0]) for g in split]
    if whole is None or None in parts or whole <= sum(parts):
        return None
    return (f"fused, the latency model predicts one kernel slower: {whole * 1e6:.1f} us, against "
            f"{sum(parts) * 1e6:.1f} us as {' then '.join(g.name for g in split)} (its parallelism: "
            f"{block_count(cache(func).func)} blocks; estimates)")

def _scheduled_alone_seconds(cache: ScheduleCache, func: tirx.PrimFunc) -> float | None:
    """Predicted time of ``func`` scheduled here, each launch region a kernel of its own."""
    try:
        scheduled = cache(func).func
    except (ScheduleError, StitchError):
        return None
    gpu = hardware.for_arch(str(cache.target.attrs.get("arch", "sm_90")))
    return _priced_alone(scheduled, func, cache.target,
                         lambda work, est: window_prices.alone_seconds(gpu, latency.FITTED, work, est))


def _priced_alone(func: tirx.PrimFunc, unscheduled: tirx.PrimFunc, target, price) -> float | None:
    """``price(work, estimates)`` of a scheduled group's launch regions, each a kernel of its own:
    the latency model's stages (``stage_work``) and the static resource estimates; None where its
    launch form cannot be read."""
    try:
        lowered = lower.lower_stage("g", func, target)
    except StitchError:
        return None
    return price(stage_work(func, lowered, unscheduled, target), [estimate.stage(low.body) for low in lowered])


def breaks_join(group: Group, done: schedule.Scheduled) -> str | None:
    """Why ``done`` does not build ``group`` as the join that formed it, None where it does: a
    window chain is one ``WindowChain`` kernel (as dlight's Fallback, say, its tile would go
    through global memory, with per-term loads the latency model misses: 9x the L1 sectors)."""
    if group.window_at and done.rule != "WindowChain":
        return f"fused, {done.rule} schedules it: not the window chain's one kernel"
    return None


def schedules_alone(mod: tvm.IRModule, unscheduled: tvm.IRModule, groups: list[Group], target: tvm.target.Target,
                    timer: window_prices.Timer, gemm_k_tile: int | None = None) -> dict[int, tirx.PrimFunc]:
    """Per group, the schedule v2 gives it (the default rules' block size) where the latency
    model predicts it faster than the stitchable one as a kernel of its own; each such group's
    time is recorded in ``timer.rescheduled``, so the partitioner prices a boundary around it at
    what will be built."""
    calls, raw = GroupCalls(mod, groups), GroupCalls(unscheduled, groups)
    cache = ScheduleCache(target, None, gemm_k_tile)
    out: dict[int, tirx.PrimFunc] = {}
    seconds: dict = {}     # unscheduled function -> (v2 schedule, its time): repeated blocks share one
    for i, g in enumerate(groups):
        if g.opaque is not None or i not in calls.call_index or not timer.facts.work[i]:
            continue
        if raw.func(i) not in seconds:
            v2 = cache(raw.func(i))
            seconds[raw.func(i)] = (v2, _alone_seconds(v2.func, raw.func(i), target, timer))
        v2, alt = seconds[raw.func(i)]
        if breaks_join(g, v2) is None and alt is not None and alt < timer.stitchable_alone(i):
            out[i], timer.rescheduled[i] = v2.func, alt
    return out


def reschedule_alone(mod: tvm.IRModule, groups: list[Group], subprograms: list[tuple[list[int], str]],
                     alone: dict[int, tirx.PrimFunc]) -> tvm.IRModule:
    """Groups left as kernels of their own get their ``alone`` schedule (``schedules_alone``); a
    function that is also a stage of a stitched subprogram keeps its stitchable schedule."""
    calls = GroupCalls(mod, groups)

    def gv_of(i: int):
        return calls.calls[calls.call_index[i]].args[0]

    keep = {gv_of(i).name_hint for idx, _ in subprograms if len(idx) > 1 for i in idx if i in calls.call_index}
    out = tvm.IRModule(dict(mod.functions), attrs=mod.attrs)
    for idx, _ in subprograms:
        if len(idx) == 1 and idx[0] in alone and gv_of(idx[0]).name_hint not in keep:
            out.update_func(gv_of(idx[0]), alone[idx[0]])
    return out


def _alone_seconds(func: tirx.PrimFunc, unscheduled: tirx.PrimFunc, target, timer: window_prices.Timer) -> float | None:
    """Predicted time of a scheduled group as kernels of its own under a CUDA graph (static
    resource estimate); None where its launch form cannot be read."""
    return _priced_alone(func, unscheduled, target, timer.alone)
