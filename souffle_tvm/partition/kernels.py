"""Kernel groups: which stages run in the same thread blocks (the paper's V2 level).

``partition_groups`` makes one group per *anchor* with what can run in the same thread blocks
without a grid-wide barrier:

* a reduction (GEMM, conv, sum, max) anchors a group;
* a following reduction joins when it reduces the same rows the group already holds
  (same spatial domain and reduce extent, reading group members element-for-element along
  the summed axis: softmax's max → sum, LayerNorm's mean → variance);
* a one-to-one stage joins as an epilogue when every non-weight input comes from the group;
* a cheap one-to-one stage whose only reader is the next stage, a contraction reading it as an
  operand, and whose large input comes from an earlier kernel (squeeze-excite's ``x * scale``
  before the projection) is that contraction's *prologue*: it starts the contraction's group and
  is applied as the GEMM copies its operand tile into shared memory (its output never exists
  in global memory), instead of being written by the kernel that made the small input;
* a windowed reduction that reads the group's contraction through a window over its two
  innermost axes, each output channel its own input channel (a depthwise convolution after
  MBConv's expansion) joins it as a *window chain*: each block computes the tile of the
  contraction its windows read, halo included, into shared memory
  (``codegen.rules.WindowChain``); the expanded tensor never goes to global memory;
* a row chain (``te.chains``: attention's ``Q Kᵀ`` → softmax → ``P V``) is one group: each
  block holds whole rows, so its reductions need no grid-wide barrier and its rows never
  leave the chip (with ``row_chains``);
* anything else starts a new group, and the reason is recorded.

``split_unschedulable`` is schedule feedback: given, per candidate group, why the code
generator cannot schedule it as well as its anchor alone, it splits such groups.
"""

from __future__ import annotations

import math

from tvm import te

from ..core.ir_names import ATOMIC_ATTR, PARTIAL_TAG
from ..cost import tir_stats
from ..te import analysis, chains as te_chains, rewrite as te_rewrite
from ..te.program import TEProgram
from .groups import Group, Partition, readers_of


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
            pattern, reuse = analysis.access_pattern(op, prod, idx)
            if pattern == "reduce-read" and reuse > 1:
                return False
    return True


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


ROW_CHAIN = "row chain: a block holds whole rows of {head} and finishes them through {tail}, on chip"
PROLOGUE = ("prologue: {stage} is applied as {gemm} loads its operand tile into shared memory ({saved} bytes "
            "an epilogue would write and {gemm} read back stay on chip)")
# The most arithmetic per element a prologue may have: a contraction's blocks apply it once
# per operand tile they load (one per block column), so it must be cheap to repeat.
PROLOGUE_MAX_FLOPS = 4


def _contraction_operand(consumer: te.ComputeOp, producer: te.Tensor) -> bool:
    """Whether every load of ``producer`` by ``consumer`` is a contraction's operand: indexed by a
    summed axis and broadcast along an output axis (a GEMM's, not a depthwise window's, reuse)."""
    loads = [idx for prod, idx in te_rewrite.loads(consumer.body[0]) if prod.op == producer.op]
    spatial = [ax.var for ax in consumer.axis if int(ax.dom.extent) > 1]
    reduce_vars = {rv.var for rv in consumer.reduce_axis}
    for idx in loads:
        used = {v for i in idx for v in tir_stats.vars_in(i)}
        if not used & reduce_vars or all(v in used for v in spatial):
            return False
    return bool(loads)


SHIFTED = ("{stage} selects among shifted pieces of {group}'s output (a concatenation, a cyclic shift): its "
           "elements come from rows other blocks compute, so it is stored by a kernel of its own")
WINDOW = ("window chain: {window} reads {anchor}'s output through a window; each block computes the "
          "tile its windows read, halo included, in shared memory")


def _window_chain(op: te.ComputeOp, group: Group, members: set, readers: dict) -> bool:
    """Whether reduction ``op`` reads the group's single contraction (through its epilogue)
    through a window over the two innermost axes only: every summed axis longer than one is in
    those two indices of every load of a member, each with an output position (a depthwise
    convolution; not a grouped or dense one, not a global pool); it reads an elementwise stage
    after the contraction (its activation), and nothing else reads that (``readers``: op -> the
    ops reading it)."""
    anchor = group.anchor
    if anchor is None or group.window_at or group.prologue or group.row_chain or _atomic(group) or \
            sum(bool(m.op.reduce_axis) for m in group.members) != 1 or anchor.op.tag == PARTIAL_TAG:
        return False
    read = [prod.op for prod, _ in te_rewrite.loads(op.body[0]) if prod.op in members]
    if any(readers.get(r, set()) != {op} or r.reduce_axis for r in read):
        return False         # on chip only where the window alone reads it, through the contraction's epilogue
    long_terms = {rv.var for rv in op.reduce_axis if int(rv.dom.extent) > 1}
    sliding = {ax.var for ax in op.axis if int(ax.dom.extent) > 1}
    loads = [idx for prod, idx in te_rewrite.loads(op.body[0]) if prod.op in members]
    if not loads or not long_terms or len(op.axis) < 3:
        return False
    for idx in loads:      # each of the two innermost indices an output position plus a window offset
        if len(idx) < 3 or any(tir_stats.vars_in(i) & long_terms for i in idx[:-2]) or \
                not all(tir_stats.vars_in(i) & long_terms and tir_stats.vars_in(i) & sliding for i in idx[-2:]):
            return False     # a pool over the whole map (no output position) is not a window
    return True


def _prologue(t: te.Tensor, nxt: te.Tensor | None, readers: dict, members: set, placeholders: set) -> bool:
    """Whether one-to-one stage ``t`` is better the prologue of ``nxt`` than an epilogue of the
    group ``members``: ``nxt`` alone reads it, as a contraction's operand; it is cheap to repeat;
    and what it reads of the group is smaller than what it writes (a broadcast scale: as an
    epilogue the group would write, and the contraction read back, the large tensor)."""
    op = t.op
    if nxt is None or readers.get(op, set()) != {nxt.op} or analysis.classify(nxt.op)[0] != analysis.REDUCTION:
        return False
    if not _contraction_operand(nxt.op, t) or tir_stats.expr_flops(op.body[0]) > PROLOGUE_MAX_FLOPS:
        return False
    inputs = [x for x in op.input_tensors if x.op not in placeholders]
    from_group = sum(analysis.tensor_bytes(x) for x in inputs if x.op in members)
    from_earlier = [x for x in inputs if x.op not in members]
    return bool(from_earlier) and from_group * 4 <= analysis.tensor_bytes(t)


def partition_groups(prog: TEProgram, row_chains: bool = True) -> Partition:
    """Group the (transformed) program's stages into kernels by the rules above. ``row_chains``
    off (``--off-chip``): no on-chip chain at all (no row chain, prologue or window chain)."""
    chain_of = ({m.op: c for c in te_chains.row_chains(prog.stages(), readers_of(prog)) for m in c.stages}
                if row_chains else {})
    placeholders = {t.op for t in prog.placeholders()}
    opaque_of = {out.op: o for o in prog.opaque for out in o.outputs}
    groups: list[Group] = []
    emitted_opaque = set()

    def producers(op) -> set:
        return {x.op for x in op.input_tensors if x.op not in placeholders}

    def add_opaque(first) -> None:
        """``first`` as a group, after the opaque ops whose results it reads (depth first)."""
        stack = [(first, False)]
        while stack:
            o, ready = stack.pop()
            if o.name in emitted_opaque:
                continue
            deps = [d for d in (opaque_of.get(t.op) for t in o.inputs.values())
                    if d is not None and d.name not in emitted_opaque]
            if ready or not deps:
                emitted_opaque.add(o.name)
                groups.append(Group(opaque=o, reason=f"opaque op ({o.reason})"))
            else:
                stack.append((o, True))
                stack.extend((d, False) for d in deps)

    readers = readers_of(prog)
    order = _partials_first(prog.stages())
    for pos, t in enumerate(order):
        op = t.op
        for p in {x.op for x in op.input_tensors}:   # opaque results this stage needs come first
            o = opaque_of.get(p)
            if o is not None:
                add_opaque(o)
        current = groups[-1] if groups and groups[-1].opaque is None else None
        members = {m.op for m in current.members} if current else set()
        kind = analysis.classify(op)[0]
        prods = producers(op)
        chain = chain_of.get(op)
        if op in members:
            current.members.append(t)      # another output of an op the group computes (argmin's value)
            continue
        if chain is not None and not op.same_as(chain.head.op):
            if current is not None and current.row_chain:
                current.members.append(t)
                continue
            reason = "a row chain broken by an opaque op"
        elif current is not None and current.row_chain:
            reason = "after a row chain"      # the chain's group is its own kernel
        elif chain is not None:
            groups.append(Group([t], reason=ROW_CHAIN.format(head=op.name, tail=chain.tail.op.name), row_chain=True))
            continue
        elif current is None:
            reason = "start" if not groups else "after an opaque op"
        elif current.prologue and current.anchor is None and kind == analysis.REDUCTION and prods & members:
            current.members.append(t)      # the contraction its prologue was made for
            continue
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
            if row_chains and prods & members and _window_chain(op, current, members, readers):
                current.window_at = len(current.members)
                current.members.append(t)
                current.window_reason = WINDOW.format(window=op.name, anchor=current.anchor.op.name)
                continue
            reason = ("reduction over data the previous kernel is still producing (needs a grid-wide sync)"
                      if prods & members else "reduction of data produced by earlier kernels")
        else:
            nxt = order[pos + 1] if pos + 1 < len(order) else None
            if row_chains and kind == analysis.ONE_TO_ONE and nxt is not None and chain_of.get(nxt.op) is None and \
                    _prologue(t, nxt, readers, members, placeholders):
                saved = 2 * analysis.tensor_bytes(t)
                groups.append(Group([t], reason=PROLOGUE.format(gemm=nxt.op.name, stage=op.name, saved=saved),
                                    prologue=True))
                continue
            # a concatenation left a stage of its own (transforms.vertical: a contraction reads it)
            shifted = bool(prods & members) and analysis.selects_among_loads(op) and \
                tir_stats.expr_flops(op.body[0]) == 0
            if prods & members and not _atomic(current) and not shifted:
                current.members.append(t)
                continue
            reason = (SHIFTED.format(stage=op.name, group=current.name) if shifted
                      else "reads sums accumulated with atomics, complete only after a grid sync" if prods & members
                      else "one-to-one stage reads no data of the previous kernel")
        groups.append(Group([t], reason=reason))
    for o in prog.opaque:
        add_opaque(o)
    return Partition(groups)


def is_row_chain(group: Group) -> bool:
    """Whether ``group`` holds a row chain whole (an opaque op may have broken one off after its head)."""
    return group.row_chain and len(group.members) > 2


def unchained(group: Group, why: str = "") -> list[Group]:
    """A row chain's stages grouped as without the chain: its head, the stages between (one
    group: the row reductions reduce the same rows, the element-wise stages are their
    epilogues) and its tail, each reading what the one before it is still producing."""
    note = f" (row chain not taken: {why})" if why else ""
    later = f"reduction over data the previous kernel is still producing{note}"
    members = group.members
    return [Group(members[:1], reason="row chain not taken" + (f": {why}" if why else "")),
            Group(members[1:-1], reason=later), Group(members[-1:], reason=later)]


def parts_of(group: Group, why: str = "") -> list[Group]:
    """The groups ``group`` would be without the rule that joined them, each with the reason of
    its boundary: a row chain's three (``unchained``); a prologue and its contraction; a window
    chain's contraction and its window; else all but the last member, and the last."""
    if is_row_chain(group):
        return unchained(group, why)
    members = group.members
    if group.prologue:
        head, tail = Group(members[:1], reason=group.reason), Group(members[1:])
        head.reason = f"prologue not taken: fusing {members[0].op.name} into {tail.name}" + (f": {why}" if why else "")
        tail.reason = "reduction of data produced by earlier kernels"
        return [head, tail]
    if group.window_at:
        head = Group(members[:group.window_at], reason=group.reason)
        tail = Group(members[group.window_at:])
        tail.reason = ("window chain not taken" + (f": {why}" if why else "") +
                       "; reduction over data the previous kernel is still producing (needs a grid-wide sync)")
        return [head, tail]
    return [Group(members[:-1], reason=group.reason), Group(members[-1:])]


def split_unschedulable(group: Group, why_not: str | None) -> list[Group]:
    """Schedule feedback: ``why_not`` says why the group cannot be scheduled as one kernel as
    well as its anchor alone (None: it can). A group with a prologue gives that up first (its
    contraction and epilogues stay one group); any other group gives up its last member, which
    becomes a group of its own with the reason (both are then judged again, the head first);
    a single stage keeps the reason; a row chain falls apart into the groups it would have
    been without the chain (``unchained``). Returns ``[group]`` when it stays as it is."""
    if why_not is not None and is_row_chain(group):
        return unchained(group, why_not)
    if why_not is not None and (group.prologue or group.window_at) and len(group.members) > 1:
        return parts_of(group, why_not)
    if why_not is None or len(group.members) == 1:
        if why_not is not None:
            group.reason += f"; cannot be scheduled: {why_not}"
        return [group]
    head, tail = Group(group.members[:-1], reason=group.reason), Group(group.members[-1:])
    tail.reason = f"schedule: fusing {tail.members[0].op.name} into {group.name}: {why_not}"
    return [head, tail]
