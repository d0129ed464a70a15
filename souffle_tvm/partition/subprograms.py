"""Subprograms: which consecutive groups are stitched into ONE cooperative kernel (V3).

Everything the decision needs about a group comes in as data, ``GroupFacts``, computed once by
the pipeline (``planning.group_facts.group_facts``): whether it can be stitched, its size in
lowered statements, the static resource estimate of its stages, its code signature and the
earlier group it repeats. ``by_budget`` (the default) and ``by_normalization`` draw the
boundaries from those facts and the GPU's limits; every boundary keeps its reason
(docs/partitioner.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Hashable

from ..cost import estimate, hardware
from ..core.geometry import STITCH_BLOCK
from ..te import analysis
from ..te.analysis import tensor_bytes
from ..te.program import TEProgram
from .groups import Group, readers_of
from ..cost.work import Stage


@dataclass
class GroupFacts:
    """Per group (by position in the partition), what the subprogram partitioner decides from.

    ``unstitchable[i]``: why group i cannot be a stage of a stitched kernel (None: it can; an
    opaque op always cannot). ``statements[i]``: its lowered TIR statements (the compile-time
    budget). ``stages[i]``: the static estimate of each of its lowered stages. ``signature[i]``:
    equal for groups with identical code (repeated layers). ``repeat_of[i]``: the earlier group
    that group i repeats with its inputs one period later (``stitch.repeats``), rolled
    into a loop when stitched; None if none. ``work[i]``: per lowered stage, the tiles and threads
    it launches alone, its bytes and flops (on its first stage), whether it uses tensor
    cores and what a block of it executes stitched (K steps, shared wavefronts, global sectors;
    the report prices a built stitched kernel's stages from the same: ``alone_work``:
    built alone): what the time-driven partitioner (``by_time``) predicts from. ``kernel_keys[i]``: group
    i's kernel in the measured-times database (``cost.measured``), None for a multi-launch group.
    """

    unstitchable: list[str | None]
    statements: list[int] = field(default_factory=list)
    stages: list[list[estimate.Estimate]] = field(default_factory=list)
    signature: list[Hashable] = field(default_factory=list)
    repeat_of: list[int | None] = field(default_factory=list)
    work: list[list[Stage]] = field(default_factory=list)
    kernel_keys: list[str | None] = field(default_factory=list)   # cost.measured keys of single-launch groups
    # per group: (producer, bytes of its reads that stay on chip when stitched with that producer)
    # or None (``planning.onchip_credit``); empty: no credits
    onchip: list[tuple[int, int] | None] = field(default_factory=list)
    # per group: ``work`` as its stages execute built as kernels of their own (TVM's pipeline
    # places their barriers; ``planning.block_counts.stage_work``); empty: as ``work``
    alone_work: list[list[Stage]] = field(default_factory=list)
    # per group: the producers whose output it reads block-locally when stitched with them (no
    # grid sync between them; ``planning.onchip_credit``); empty: none known
    local_producers: list[set[int]] = field(default_factory=list)
    # per group: its code less its integer constants (``stitch.rolling.skeleton_hash``): equal
    # for a recurrence's steps, which differ only in the step's offsets; empty: not asked
    code: list[Hashable] = field(default_factory=list)

    def kernel_estimate(self, indices: list[int]) -> estimate.Estimate:
        """The static estimate of these groups stitched into one kernel."""
        return estimate.kernel([e for i in indices for e in self.stages[i]])


def why_over_budget(facts: GroupFacts, indices: list[int], gpu: hardware.GPU,
                    block: int = STITCH_BLOCK) -> str | None:
    """The resource limit a candidate subprogram breaks, from the static estimate of its stitched
    kernel: no spills, and at least one block per SM co-resident (the one-wave grid of the paper)."""
    est = facts.kernel_estimate(indices)
    if est.spills:
        return f"registers: more than {estimate.MAX_REGISTERS} per thread (estimated), ptxas would spill"
    occ = hardware.occupancy(gpu, block, est.registers, est.shared_bytes)
    if occ.blocks_per_sm < 1:
        # above 48 KB the build makes shared memory dynamic: then the opt-in size is the limit
        optin = f", over the {gpu.smem_per_block_optin} B of dynamic shared memory a block may opt in to" \
            if est.shared_bytes > gpu.smem_per_block_optin else ""
        return (f"{occ.limited_by}: {est.registers} registers, {est.shared_bytes} B shared memory per "
                f"block (estimated{optin}) leave no block of {block} threads co-resident on an SM")
    return None


def estimated_grid(facts: GroupFacts, indices: list[int], gpu: hardware.GPU, block: int = STITCH_BLOCK) -> int:
    """The first grid of a stitched kernel: as many blocks as the static estimate lets be
    co-resident (at least one per SM); the build checks it against ptxas' figures."""
    est = facts.kernel_estimate(indices)
    return max(hardware.occupancy(gpu, block, est.registers, est.shared_bytes).blocks_per_sm, 1) * gpu.sms


# Stitched kernels of thousands of stages crash TVM's lowering (a segfault seen on the full
# 10x100 LSTM unrolled); groups that repeat an earlier one of the subprogram (rolled into a
# loop) do not count.
MAX_GROUPS_PER_SUBPROGRAM = 128


def code_repeats(facts: GroupFacts) -> GroupFacts:
    """``facts`` with each group repeating the latest earlier group of the same code (``code``:
    its constants aside), wherever it is: the compile-time budget of a wave kernel. Its waves run in
    one loop (``stitch.waves``, ``stitch.ramps``), each distinct cell's code once, plus the
    cells that differ (a layer's first and last steps); a group then adds code only where its
    code is new. Where that proxy is wrong the stitcher still sees it: a wave kernel writing out
    more than ``MAX_GROUPS_PER_SUBPROGRAM`` stage loops is stitched in the order given, and the
    driver runs again without waves (``pipeline.results.run``)."""
    if not facts.code:
        return facts
    latest: dict = {}
    rep: list[int | None] = []
    for i, sig in enumerate(facts.code):
        rep.append(latest.get(sig) if sig is not None else None)
        if sig is not None:
            latest[sig] = i
    return replace(facts, repeat_of=rep)


def by_normalization(groups: list[Group], readers: dict, unstitchable: list[str | None] | None = None,
                     max_groups: int = MAX_GROUPS_PER_SUBPROGRAM) -> list[tuple[list[int], str]]:
    """The first V3 rule (``--partitioner blocks``; ``by_budget`` is the default): cut after every
    normalisation-like group — several reductions over the same rows whose result is read by
    two or more later groups (a LayerNorm feeding a GEMM and a residual) — at opaque ops, and
    around a group that cannot be stitched (``unstitchable[i]`` says why).

    Returns (group indices, reason for the cut that ends the subprogram).
    """
    out, current = [], []
    owner = {m.op: i for i, g in enumerate(groups) for m in g.members}
    for i, g in enumerate(groups):
        why = (f"opaque op ({g.opaque.reason})" if g.opaque is not None
               else unstitchable[i] if unstitchable is not None else None)
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


def split_point(cost: Callable[[int, int, int], int], indices: list[int]) -> int:
    """Where to split a subprogram that did not fit after all: the cheapest cut, nearest the middle."""
    i, j = indices[0], indices[-1]
    return min(range(i, j), key=lambda c: (cost(i, j, c), abs(c - (i + j) // 2)))


# Compile-time budget of one stitched kernel, in lowered TIR statements: nvcc's time grows
# faster than linearly with a kernel's size (full BERT-base fp32: 24 kernels of ~5 groups,
# 26 s; 2 kernels of 64-128 groups, 130 s), while repeated layers cost nothing once their
# kernels are identical (they are then one function, called once per layer).
MAX_STATEMENTS_PER_SUBPROGRAM = 512


def by_budget(groups: list[Group], cost: Callable[[int, int, int], int], facts: GroupFacts,
              gpu: hardware.GPU, forced: dict[int, str] | None = None,
              max_statements: int = MAX_STATEMENTS_PER_SUBPROGRAM,
              max_groups: int = MAX_GROUPS_PER_SUBPROGRAM) -> list[tuple[list[int], str]]:
    """The resource-aware partition of groups into stitched subprograms.

    Grow the current subprogram in topological order while the static estimate of its stitched
    candidate fits the ``gpu`` (``why_over_budget``) and it stays within the compile-time budget
    (``facts.statements``, at most ``max_statements``, and ``max_groups`` groups). A group that cannot be stitched (opaque op, a schedule with another
    block size) ends it. When a *budget* ends it, the boundary goes where the fewest bytes must
    cross it (``cost(i, j, k)``, see ``cut_cost``) within the grown window ``i..j`` — preferring,
    among equals, a cut after which the
    next subprogram starts with the same group as this one (``facts.signature``), so repeated layers
    become identical kernels — not blindly at the window's end.

    ``forced`` maps a group to the reason a boundary must follow it (feedback from ptxas on an
    earlier build: a stitched kernel that spilled or could not be co-resident).

    A group that repeats one already in the subprogram (``facts.repeat_of``) is rolled into a
    loop when stitched, so it adds nothing to either budget.

    Returns (group indices, the reason for the boundary that ends the subprogram).
    """
    sig = facts.signature or list(range(len(groups)))
    rep = facts.repeat_of or [None] * len(groups)
    size = facts.statements or [1] * len(groups)
    forced = forced or {}

    def unstitchable(i: int) -> str | None:
        g = groups[i]
        return f"opaque op ({g.opaque.reason})" if g.opaque is not None else facts.unstitchable[i]

    out: list[tuple[list[int], str]] = []
    i, n = 0, len(groups)
    while i < n:
        why = unstitchable(i)
        if why is not None:
            out.append(([i], f"not stitchable: {why}"))
            i += 1
            continue
        j, stop, used, count = i, "end of model", size[i], 1
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
            if not rolled and (count + 1 > max_groups or used + size[j + 1] > max_statements):
                stop = (f"compile-time budget: {max_groups} groups or {max_statements} statements "
                        "per stitched kernel")
                break
            over = why_over_budget(facts, list(range(i, j + 2)), gpu)
            if over is not None:
                stop = f"adding {nxt.name} breaks a resource limit: {over}"
                break
            j += 1
            if not rolled:
                used += size[j]
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
