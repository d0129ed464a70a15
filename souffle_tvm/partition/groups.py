"""The partitioner: where kernel boundaries go, each with a named reason.

This module is the ONE place that decides boundaries, in two steps. ``partition_v2`` (the
paper's V2 ablation level: vertical fusion, no grid synchronisation) makes one group per
*anchor* with what can run in the same thread blocks without a grid-wide barrier:

* a reduction (GEMM, conv, sum, max) anchors a group;
* a following reduction joins when it reduces the same rows the group already holds
  (same spatial domain and reduce extent, reading group members element-for-element along
  the summed axis: softmax's max → sum, LayerNorm's mean → variance);
* a one-to-one stage joins as an epilogue when every non-weight input comes from the group;
* anything else starts a new group, and the reason is recorded.

At V3, ``subprograms_by_budget`` joins consecutive groups into subprograms, each stitched into
one cooperative kernel, until a stage cannot be stitched, a resource limit or the compile-time
budget is reached (docs/partitioner.md); every boundary keeps its reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from tvm import te

from ..te import analysis, rewrite as te_rewrite
from ..te.program import OpaqueStage, TEProgram
from ..core.ir_names import ATOMIC_ATTR, PARTIAL_TAG


@dataclass
class Group:
    """One future kernel (or an opaque op): its member stages in topological order."""

    members: list[te.Tensor] = field(default_factory=list)
    opaque: OpaqueStage | None = None
    reason: str = ""           # why this group starts here (the boundary before it)

    @property
    def anchor(self) -> te.Tensor | None:
        return next((m for m in self.members if analysis.classify(m.op)[0] == analysis.REDUCTION), None)

    @property
    def name(self) -> str:
        if self.opaque is not None:
            return self.opaque.name
        a = self.anchor
        return (a if a is not None else self.members[0]).op.name


@dataclass
class Partition:
    groups: list[Group]


def _spatial(op: te.ComputeOp) -> list[int]:
    return [int(ax.dom.extent) for ax in op.axis]


def _reduce_extent(op: te.ComputeOp) -> int:
    return math.prod(int(rv.dom.extent) for rv in op.reduce_axis)


def _joins_rows(op: te.ComputeOp, group: Group, members: set) -> bool:
    """A reduction that re-reduces the rows its group already produced."""
    anchor = group.anchor
    if anchor is None or _spatial(op) != _spatial(anchor.op) or _reduce_extent(op) != _reduce_extent(anchor.op):
        return False
    for prod, idx in te_rewrite.loads(op.body[0]):
        if prod.op in members:
            pattern, reuse, _ = analysis.access_pattern(op, prod, idx)
            if pattern == "reduce-read" and reuse > 1:
                return False
    return True


def readers_of(prog: TEProgram) -> dict:
    """op -> the ops (stages, opaque output placeholders) that read it; program outputs too."""
    readers: dict = {}
    for t in prog.stages():
        for x in t.op.input_tensors:
            readers.setdefault(x.op, set()).add(t.op)
    for o in prog.opaque:
        for x in o.inputs.values():
            readers.setdefault(x.op, set()).add(o.outputs[0].op)
    for t in prog.outputs:
        readers.setdefault(t.op, set()).add(None)      # None: read by the caller of main
    return readers


def outputs_of(group: Group, readers: dict) -> list[te.Tensor]:
    """The group's members that something outside the group reads."""
    own = {m.op for m in group.members}
    return [m for m in group.members if readers.get(m.op, set()) - own]


def group_outputs(prog: TEProgram, groups: list[Group]) -> dict[int, list[te.Tensor]]:
    """Per group (by id): its members read by another group, an opaque op or the program."""
    readers = readers_of(prog)
    return {id(g): outputs_of(g, readers) for g in groups}


Fits = Callable[[Group, list[te.Tensor]], "str | None"]


def _split_until_fits(prog: TEProgram, groups: list[Group], fits: Fits) -> list[Group]:
    """Schedule feedback: a group no schedule can build as one kernel is split, with the reason."""
    out: list[Group] = []
    pending = list(groups)
    readers = readers_of(prog)
    while pending:
        g = pending.pop(0)
        if g.opaque is not None:
            out.append(g)
            continue
        outputs = outputs_of(g, readers)
        err = fits(g, outputs)
        if err is None or len(g.members) == 1:
            if err is not None:
                g.reason += f"; cannot be scheduled: {err}"
            out.append(g)
            continue
        head, tail = Group(g.members[:-1], reason=g.reason), Group(g.members[-1:])
        tail.reason = f"schedule: fusing {tail.members[0].op.name} into {g.name}: {err}"
        pending[:0] = [head, tail]
    return out


def _atomic(group: Group) -> bool:
    return any(ATOMIC_ATTR in (m.op.attrs or {}) for m in group.members)


def _partials_first(stages: list[te.Tensor]) -> list[te.Tensor]:
    """The topological order with each two-phase partial right after its last producer, so it
    joins the kernel of the GEMM it reduces (and its sibling partials), ahead of the combines."""
    order = [t for t in stages if t.op.tag != PARTIAL_TAG]
    for t in stages:
        if t.op.tag == PARTIAL_TAG:
            inputs = {x.op for x in t.op.input_tensors}
            pos = max((i for i, u in enumerate(order) if u.op in inputs), default=-1)
            order.insert(pos + 1, t)
    return order


def partition_v2(prog: TEProgram, fits: Fits | None = None) -> Partition:
    """Group the (transformed) program's stages into kernels by the V2 rules above.

    ``fits(group, outputs)`` returns None when the group can be built as one kernel, or the
    reason it cannot; such groups are split (schedule feedback).
    """
    placeholders = {t.op for t in prog.placeholders()}
    opaque_of = {out.op: o for o in prog.opaque for out in o.outputs}
    groups: list[Group] = []
    emitted_opaque = set()

    def producers(op) -> set:
        return {x.op for x in op.input_tensors if x.op not in placeholders}

    for t in _partials_first(prog.stages()):
        op = t.op
        for p in {x.op for x in op.input_tensors}:   # opaque results this stage needs come first
            o = opaque_of.get(p)
            if o is not None and o.name not in emitted_opaque:
                emitted_opaque.add(o.name)
                groups.append(Group(opaque=o, reason=f"opaque op ({o.reason})"))
        current = groups[-1] if groups and groups[-1].opaque is None else None
        members = {m.op for m in current.members} if current else set()
        kind = analysis.classify(op)[0]
        prods = producers(op)
        if current is None:
            reason = "start" if not groups else "after an opaque op"
        # Producers outside ``members`` belong to earlier kernels, whose results are complete in
        # global memory before this kernel starts; only reads of ``members`` must stay block-local.
        elif op.tag == PARTIAL_TAG:
            if prods & members and current.anchor.op.tag == PARTIAL_TAG and _joins_rows(op, current, members):
                current.members.append(t)      # a sibling partial over the same tiles
                continue
            reason = ("first phase of a two-phase reduction: each block reduces the GEMM tile it wrote "
                      "(block-local when the stitcher can prove it)")
        elif kind == analysis.REDUCTION:
            if prods & members and _joins_rows(op, current, members):
                current.members.append(t)
                continue
            reason = ("reduction over data the previous kernel is still producing (needs a grid-wide sync)"
                      if prods & members else "reduction of data produced by earlier kernels")
        else:
            if prods & members and not _atomic(current):
                current.members.append(t)
                continue
            reason = ("reads sums accumulated with atomics, complete only after a grid sync" if prods & members
                      else "one-to-one stage reads no data of the previous kernel")
        groups.append(Group([t], reason=reason))
    for o in prog.opaque:
        if o.name not in emitted_opaque:
            groups.append(Group(opaque=o, reason=f"opaque op ({o.reason})"))
    if fits is not None:
        groups = _split_until_fits(prog, groups, fits)
    return Partition(groups)


# Stitched kernels of thousands of stages crash TVM's lowering (a segfault seen on the full
# 10x100 LSTM unrolled); groups that repeat an earlier one of the subprogram (rolled into a
# loop) do not count.
MAX_GROUPS_PER_SUBPROGRAM = 128


def subprograms_by_normalization(groups: list[Group], readers: dict,
                                 stitchable: Callable[[int], "str | None"] = lambda i: None,
                                 max_groups: int = MAX_GROUPS_PER_SUBPROGRAM) -> list[tuple[list[int], str]]:
    """The first V3 rule (``--partitioner blocks``; ``subprograms_by_budget`` is the default): cut after every
    normalisation-like group — several reductions over the same rows whose result is read by
    two or more later groups (a LayerNorm feeding a GEMM and a residual) — at opaque ops, and
    around a group that cannot be stitched (``stitchable(i)`` returns why).

    Returns (group indices, reason for the cut that ends the subprogram).
    """
    out, current = [], []
    owner = {m.op: i for i, g in enumerate(groups) for m in g.members}
    for i, g in enumerate(groups):
        why = f"opaque op ({g.opaque.reason})" if g.opaque is not None else stitchable(i)
        if why is not None:
            if current:
                out.append((current, f"next group is not stitchable: {why}"))
            out.append(([i], f"not stitchable: {why}"))
            current = []
            continue
        current.append(i)
        if len(current) == max_groups:
            out.append((current, f"stage cap: {max_groups} groups per stitched kernel (interim compile-time limit)"))
            current = []
            continue
        reductions = sum(1 for m in g.members if analysis.classify(m.op)[0] == analysis.REDUCTION)
        consumers = {owner.get(r) for m in g.members for r in readers.get(m.op, ()) if r is not None} - {i}
        if reductions >= 2 and len(consumers) >= 2:
            out.append((current, f"after normalisation {g.name} (rule: one attention / FFN block per subprogram)"))
            current = []
    if current:
        out.append((current, "end of model"))
    return out


def cut_cost(prog: TEProgram, groups: list[Group]) -> Callable[[int, int, int], int]:
    """``cost(i, j, k)``: bytes that go through global memory *because* a subprogram grown over
    groups ``i..j`` is cut after group ``k`` — tensors made in ``i..k`` and read in ``k+1..j+1``
    (``j+1`` starts the next subprogram whatever the cut). Tensors read only further on (the
    model's outputs, a far skip connection) cross anyway and do not count."""
    from ..te.analysis import tensor_bytes

    owner = {m.op: i for i, g in enumerate(groups) for m in g.members}
    for i, g in enumerate(groups):
        if g.opaque is not None:
            for t in g.opaque.outputs:
                owner[t.op] = i
    readers = readers_of(prog)
    made: dict[int, list] = {}
    for op, i in owner.items():
        rs = {owner.get(r, i) for r in readers.get(op, set()) if r is not None} - {i}
        if rs:
            made.setdefault(i, []).append((tensor_bytes(op.output(0)), rs))

    def cost(i: int, j: int, k: int) -> int:
        return sum(size for g in range(i, k + 1) for size, rs in made.get(g, ())
                   if any(k < r <= j + 1 for r in rs))

    return cost


Fit = Callable[[list[int]], "str | None"]


def split_point(cost: Callable[[int, int, int], int], indices: list[int]) -> int:
    """Where to split a subprogram that did not fit after all: the cheapest cut, nearest the middle."""
    i, j = indices[0], indices[-1]
    return min(range(i, j), key=lambda c: (cost(i, j, c), abs(c - (i + j) // 2)))

# Compile-time budget of one stitched kernel, in lowered TIR statements: nvcc's time grows
# faster than linearly with a kernel's size (full BERT-base fp32: 24 kernels of ~5 groups,
# 26 s; 2 kernels of 64-128 groups, 130 s), while repeated layers cost nothing once their
# kernels are identical (they are then one function, called once per layer).
MAX_STATEMENTS_PER_SUBPROGRAM = 512


def subprograms_by_budget(groups: list[Group], cost: Callable[[int, int, int], int],
                          stitchable: Callable[[int], "str | None"], fits: Fit,
                          size: Callable[[int], int] = lambda i: 1, signature: list | None = None,
                          max_statements: int = MAX_STATEMENTS_PER_SUBPROGRAM,
                          max_groups: int = MAX_GROUPS_PER_SUBPROGRAM,
                          forced: dict[int, str] | None = None,
                          repeat_of: list | None = None) -> list[tuple[list[int], str]]:
    """The resource-aware partition of groups into stitched subprograms.

    Grow the current subprogram in topological order while its stitched candidate fits
    (``fits(indices)`` returns None, or the limit it breaks and by how much) and stays within
    the compile-time budget (``size(i)`` statements per group, at most ``max_statements``, and
    ``max_groups`` groups). A group that cannot be stitched (opaque op, a schedule with another
    block size) ends it. When a *budget* ends it, the boundary goes where the fewest bytes must
    cross it (``cost(i, j, k)``, see ``cut_cost``) within the grown window ``i..j`` — preferring,
    among equals, a cut after which the
    next subprogram starts with the same group as this one (``signature``), so repeated layers
    become identical kernels — not blindly at the window's end.

    ``forced`` maps a group to the reason a boundary must follow it (feedback from ptxas on an
    earlier build: a stitched kernel that spilled or could not be co-resident).

    ``repeat_of[i]``: the earlier group that group i repeats (``rolling.repeats``: same code, its
    inputs one period later). Stitching rolls such repeats into a loop, so a group that repeats
    one already in the subprogram adds nothing to either budget.

    Returns (group indices, the reason for the boundary that ends the subprogram).
    """
    sig = signature or list(range(len(groups)))
    rep = repeat_of or [None] * len(groups)
    forced = forced or {}

    def unstitchable(i: int) -> str | None:
        g = groups[i]
        return f"opaque op ({g.opaque.reason})" if g.opaque is not None else stitchable(i)

    out: list[tuple[list[int], str]] = []
    i, n = 0, len(groups)
    while i < n:
        why = unstitchable(i)
        if why is not None:
            out.append(([i], f"not stitchable: {why}"))
            i += 1
            continue
        j, stop, used, count = i, "end of model", size(i), 1
        while True:
            if j + 1 >= n:
                break
            if j in forced:
                stop = forced[j]
                break
            nxt = groups[j + 1]
            nwhy = unstitchable(j + 1)
            if nwhy is not None:
                stop = f"next group is not stitchable: {nwhy}"
                break
            rolled = rep[j + 1] is not None and rep[j + 1] >= i
            if not rolled and (count + 1 > max_groups or used + size(j + 1) > max_statements):
                stop = (f"compile-time budget: {max_groups} groups or {max_statements} statements "
                        "per stitched kernel")
                break
            over = fits(list(range(i, j + 2)))
            if over is not None:
                stop = f"adding {nxt.name} breaks a resource limit: {over}"
                break
            j += 1
            if not rolled:
                used += size(j)
                count += 1
        if stop.startswith(("compile-time", "adding")):
            # in the window's second half: a long-lived tensor made early would otherwise make
            # the first group the cheapest cut again and again
            costs = {c: cost(i, j, c) for c in range(i + (j - i) // 2, j + 1)}
            k = min(costs, key=lambda c: (costs[c], c + 1 < n and sig[c + 1] != sig[i], -c))
            stop += f"; cut after {groups[k].name}, where {costs[k]} B more cross"
            j = k
        out.append((list(range(i, j + 1)), stop))
        i = j + 1
    return out
