"""What the subprogram partitioner needs to know of every group (``partition.subprograms.GroupFacts``),
asked of the code generator and the stitcher once per group: whether it can be stitched, its
size, the static resource estimate and the latency model's view of its stages (alone and
stitched), its signature and repeats, and the on-chip credits a window would give it."""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax, tirx

from ..core.geometry import STITCH_BLOCK
from ..core.targets import is_cuda
from ..cost import estimate, hardware, measured
from ..partition.subprograms import GroupFacts
from ..stitch import lower, repeats, rolling
from ..stitch.module import ExprKey
from . import onchip_credit
from .block_counts import counted, uncounted
from .group_calls import GroupCalls, is_call_tir


def group_facts(calls: GroupCalls, target: tvm.target.Target, block: int = STITCH_BLOCK,
                sizes: bool = True, unscheduled: tvm.IRModule | None = None,
                only: set[int] | None = None) -> GroupFacts:
    """What the subprogram partitioner needs to know of every group (``sizes=False``: only
    whether it can be stitched, all the "blocks" partitioner reads). ``unscheduled``: the same
    groups before scheduling, whose flops and footprints the latency model reads (as the
    report does; a schedule's extra blocks would count work twice). ``only``: the facts of these
    groups alone (the others as if opaque), for a subprogram scheduled again at another block."""
    raw = GroupCalls(unscheduled, calls.groups) if unscheduled is not None else None
    groups = calls.groups
    asked = [g.opaque is None and (only is None or i in only) for i, g in enumerate(groups)]
    unstitchable = [lower.why_not_stitchable(calls.func(i), target, block) if asked[i] else None
                    for i in range(len(groups))]
    if not sizes:
        return GroupFacts(unstitchable)
    arch = str(target.attrs["arch"]) if "arch" in target.attrs else str(target.kind.name)
    seen: dict = {}      # (function, unscheduled function) -> facts: repeated blocks share one PrimFunc

    def facts_of(func: tirx.PrimFunc, unscheduled_func: tirx.PrimFunc) -> tuple:
        if (func, unscheduled_func) not in seen:
            lowered = lower.lower_stage("g", func, target)
            count = [0]
            for st in lowered:
                tvm_ffi.structural_walk(st.body, (tirx.Stmt, lambda _: count.__setitem__(0, count[0] + 1)))
            key = (measured.kernel_key(func, arch, lowered[0].num_blocks, lowered[0].num_threads)
                   if len(lowered) == 1 else None)
            plain = uncounted(func, lowered, unscheduled_func)     # one footprint walk for both views
            seen[(func, unscheduled_func)] = (count[0], [estimate.stage(st.body) for st in lowered],
                                              counted(plain, func, lowered, target, block), key, lowered,
                                              counted(plain, func, lowered, target, None))
        return seen[(func, unscheduled_func)]

    statements, stages, work, keys, lowered, alone = [], [], [], [], [], []
    for i, g in enumerate(groups):
        if not asked[i] or unstitchable[i] is not None:
            facts = (0, [], [], None, None, [])
        else:
            facts = facts_of(calls.func(i), raw.func(i) if raw is not None else calls.func(i))
        for column, value in zip((statements, stages, work, keys, lowered, alone), facts):
            column.append(value)
    signature = [tvm_ffi.structural_hash(calls.func(i)) if asked[i] else None for i in range(len(groups))]
    repeats = _repeats(calls) if only is None else [None] * len(groups)
    # at another block size too (``only``): a window priced there without them pays grid syncs the
    # stitcher would not put, and reads off chip what it would keep on it
    onchip, local = (onchip_credit.credits(calls, target, block, hardware.for_arch(arch), lowered, unscheduled)
                     if is_cuda(target) else ([], []))
    code = [rolling.skeleton_hash(calls.func(i)) if asked[i] and g.opaque is None else None for i, g in enumerate(groups)]
    return GroupFacts(unstitchable, statements, stages, signature, repeats, work, keys, onchip, alone, local, code)


def _repeats(calls: GroupCalls) -> list[int | None]:
    """``repeats.repeats`` over the groups: each group's code skeleton, and its call's inputs as
    the group (and output) that makes them, or the Relax value itself."""
    group_of_call = {c: i for i, c in calls.call_index.items()}
    maker, n = {}, 0
    for b in calls.bindings:
        if is_call_tir(b.value):
            maker[b.var] = (group_of_call[n], 0)
            n += 1
        elif isinstance(b.value, relax.TupleGetItem) and b.value.tuple_value in maker:
            maker[b.var] = (maker[b.value.tuple_value][0], b.value.index)
    sigs, reads = [], []
    for i, g in enumerate(calls.groups):
        if g.opaque is not None:
            sigs.append(None)
            reads.append([])
            continue
        sigs.append(rolling.skeleton_hash(calls.func(i)))
        reads.append([("group", *maker[a]) if a in maker else ("ext", ExprKey(a))
                      for a in calls.calls[calls.call_index[i]].args[1].fields])
    return repeats.repeats(sigs, reads)
