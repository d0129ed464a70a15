"""What a stitched window saves through on-chip channels, for the time-driven partitioner.

A group that reads a producer's output block-locally (``stitch.dependence``), in a kernel where
the producer's tile stays resident (``stitch.channel``), reads it from shared memory instead of
global memory once both are stitched together. The partitioner should see that saving, or it
prices every stitched edge as a round trip through global memory and can only find stitching
slower. ``credits`` asks the stitcher itself: per producer-consumer pair of groups with a stage
of equal block count, the two groups' lowered stages stitched alone (``kernel.stitch``) tell
which of the consumer's reads become channels, and the consumer's footprint of those tensors
is its credit. Only the reader's side is credited (the producer still writes the tensor when
someone outside the window reads it, which the window does not know): a lower bound.

A weight read by several groups (an LSTM layer's recurrent weights, once a step) is credited
the same way: each reader after the first reads the block's copy (``stitch.resident``) when the
first is in the window, so its footprint of the weight is its credit, with that first reader
as the "producer". The larger of a group's two credits counts.
"""

from __future__ import annotations

import tvm
from tvm import relax

from ..cost import estimate, hardware, tir_stats
from ..errors import StitchError
from ..core.geometry import STATIC_SHARED_LIMIT
from ..stitch import kernel, resident


def group_outputs(calls) -> dict:
    """Relax Var -> (group, output field) for every group call's result and its tuple items."""
    group_of = {k: i for i, k in calls.call_index.items()}
    var_call = {}
    out = {}
    k = 0
    for b in calls.bindings:
        if calls.calls and k < len(calls.calls) and b.value.same_as(calls.calls[k]):
            var_call[b.var] = group_of[k]
            if not isinstance(b.var.ty, relax.TupleType):
                out[b.var] = (group_of[k], 0)
            k += 1
    for b in calls.bindings:
        if isinstance(b.value, relax.TupleGetItem) and b.value.tuple_value in var_call:
            out[b.var] = (var_call[b.value.tuple_value], b.value.index)
    return out


def _keys(calls, i: int, outputs: dict) -> list:
    """Group ``i``'s parameters as stitch keys: inputs by what produced them, then its outputs."""
    call = calls.calls[calls.call_index[i]]
    ins = [("out",) + outputs[a] if isinstance(a, relax.Var) and a in outputs else ("in", i, j)
           for j, a in enumerate(call.args[1].fields)]
    fields = len(call.ty.fields) if isinstance(call.ty, relax.TupleType) else 1
    return ins + [("out", i, f) for f in range(fields)]


def _with_scratch(keys: list, stage) -> list:
    """A lowered stage's keys: the call's, then its own global scratch buffers (keyed apart)."""
    return keys + [("scratch", id(stage), j) for j in range(len(stage.params) - len(keys))]


def credits(calls, target: tvm.target.Target, block: int, gpu: hardware.GPU, lowered: list,
            unscheduled=None) -> tuple[list[tuple[int, int] | None], list[set[int]]]:
    """Per group, the largest credit it gets from one producer stitched with it: (the producer,
    the consumer's bytes that stay on chip), or None; and per group the producers it reads
    block-locally stitched with them (no grid sync between the two). ``lowered[i]``: group i's
    lowered stages (None where it cannot be stitched), as ``policies.group_facts`` made them;
    ``unscheduled``: the groups before scheduling (a module), whose footprints the model reads.

    Repeated layers call the same PrimFuncs with the same wiring: each distinct pair is
    stitched once."""
    outputs = group_outputs(calls)
    raw = type(calls)(unscheduled, calls.groups) if unscheduled is not None else calls
    asked: dict = {}        # (producer function, consumer function, wiring) -> (saved bytes, block-local)
    out: list[tuple[int, int] | None] = [None] * len(calls.groups)
    local: list[set[int]] = [set() for _ in calls.groups]
    for g, sg in enumerate(lowered):
        if sg is None:
            continue
        keys_g = _keys(calls, g, outputs)
        for p in producers(calls, g, outputs):
            sp = lowered[p] if p < len(lowered) else None
            if sp is None or calls.func(p).same_as(calls.func(g)) or \
                    not {s.num_blocks for s in sp} & {s.num_blocks for s in sg}:
                continue        # no stage of equal block count: no block-local read
            wiring = tuple((j, k[2]) for j, k in enumerate(keys_g) if k[:2] == ("out", p))
            pair = (calls.func(p), calls.func(g), wiring)
            if pair not in asked:
                asked[pair] = _saved(sp, sg, _keys(calls, p, outputs), keys_g, raw.func(g), target, block, gpu)
            saved, blocklocal = asked[pair]
            if saved and (out[g] is None or saved > out[g][1]):
                out[g] = (p, saved)
            if blocklocal:
                local[g].add(p)
    for g, credit in _resident_credits(calls, raw, lowered, block, gpu).items():
        if out[g] is None or credit[1] > out[g][1]:
            out[g] = credit
    return out, local


def _resident_credits(calls, raw, lowered: list, block: int, gpu: hardware.GPU) -> dict[int, tuple[int, int]]:
    """Per group, what it reads on chip as a later reader of a weight copied into each block's
    shared memory (``stitch.resident``): (the weight's first reader, the group's footprint of it),
    where the weight is read by at least ``resident.MIN_READERS`` groups, the group is one stage
    with no more blocks than can be resident, and its per-block share fits the static limit
    beside the stage's own shared memory (the stitcher proves the rest, or reads global memory)."""
    bound = {b.var for b in calls.bindings}       # a weight is a constant or a parameter of main
    readers: dict = {}          # weight expression -> its reader groups in order
    args_of = {}
    for g in calls.call_index:                    # opaque groups (TVM's own kernels) have no call of ours
        call = calls.calls[calls.call_index[g]]
        args_of[g] = list(call.args[1].fields)
        for a in args_of[g]:
            if isinstance(a, tvm.ir.Constant) or (isinstance(a, relax.Var) and a not in bound):
                groups = readers.setdefault(a, [])
                if not groups or groups[-1] != g:
                    groups.append(g)
    footprints: dict = {}
    out: dict[int, tuple[int, int]] = {}
    for weight, groups in readers.items():
        if len(groups) < resident.MIN_READERS:
            continue
        for g in groups[1:]:
            stages = lowered[g] if g < len(lowered) else None
            if stages is None or len(stages) != 1:
                continue
            est = estimate.stage(stages[0].body)
            slots = max(1, hardware.occupancy(gpu, block, est.registers, est.shared_bytes).blocks_per_sm) * gpu.sms
            func = raw.func(g)
            if func not in footprints:
                footprints[func] = tir_stats.block_footprints(func)
            j = next(j for j, a in enumerate(args_of[g]) if a.same_as(weight))
            saved = footprints[func].get(j, tir_stats.buffer_bytes(func.params[j]))
            if stages[0].num_blocks <= slots and \
                    saved // stages[0].num_blocks + est.shared_bytes <= STATIC_SHARED_LIMIT:
                out[g] = (groups[0], saved)
    return out


def block_local(calls, p: int, g: int, sp: list, sg: list, target: tvm.target.Target, block: int,
                gpu: hardware.GPU, outputs: dict | None = None) -> bool:
    """Whether group ``g``'s lowered stages ``sg`` follow producer ``p``'s ``sp`` without a grid
    sync, the two stitched alone. ``outputs``: ``group_outputs(calls)``, where it is at hand."""
    outputs = group_outputs(calls) if outputs is None else outputs
    return _saved(sp, sg, _keys(calls, p, outputs), _keys(calls, g, outputs), calls.func(g), target, block, gpu)[1]


def producers(calls, g: int, outputs: dict) -> list[int]:
    """The groups whose outputs group ``g`` reads."""
    return sorted({k[1] for k in _keys(calls, g, outputs) if k[0] == "out" and k[1] != g})


def _saved(sp: list, sg: list, keys_p: list, keys_g: list, unscheduled_g, target, block: int,
           gpu: hardware.GPU) -> tuple[int, bool]:
    """The consumer's footprint of what it reads on chip when stitched with the producer alone,
    and whether its first stage then follows the producer without a grid sync."""
    est = estimate.kernel([estimate.stage(s.body) for s in sp + sg])
    resident = max(1, hardware.occupancy(gpu, block, est.registers, est.shared_bytes).blocks_per_sm) * gpu.sms
    args = [_with_scratch(keys_p, s) for s in sp] + [_with_scratch(keys_g, s) for s in sg]
    try:
        st = kernel.stitch(sp + sg, args, resident, block, target=target, private=lambda k: False)
    except (StitchError, ValueError):
        return 0, False
    read = {ch.key for ch in st.channels if any(st.order[r] >= len(sp) for r in ch.readers)}
    footprint = tir_stats.block_footprints(unscheduled_g)
    saved = sum(footprint.get(j, tir_stats.buffer_bytes(unscheduled_g.params[j]))
                for j, k in enumerate(keys_g) if k in read and j < len(unscheduled_g.params))
    return saved, not st.syncs[st.order.index(len(sp))]
