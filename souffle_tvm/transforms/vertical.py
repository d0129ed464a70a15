"""Vertical transform: compose chains of one-to-one stages into their consumers.

A one-to-one stage P is *inlined*: each load ``P[f(i)]`` in a consumer becomes P's body at
``f(i)``, so P's index map is composed with the consumer's (a reshape → transpose chain
becomes one index expression, simplified over the consumer's domain). P then no longer exists.

P is kept, with a recorded reason, when inlining would change what runs or repeat work:
it is a model output or feeds an opaque op; or it selects among several loads (a concatenation,
a cyclic shift's slices) and a contraction would read it (through other index maps) as its
operand, which no GEMM rule tiles (a select of loads, not one buffer); or it does arithmetic
and some consumer reads each of its elements more than once (a GEMM reading a GELU output
would recompute it per output column) — such a stage stays and becomes its producer's
*epilogue* in the partition (fused at its store, computed once); or a chain of :data:`MAX_COMPOSED` stages is
composed into it already (a long element-wise chain is cut into expressions of that depth); or it
narrows a reduction's float result (a float32-accumulated fp16/bf16 GEMM's cast back,
``frontend.accumulation``): inlined, the cast would move into the consumers and the reduction
write its wide type; kept, it is the reduction's epilogue, and the narrow tensor is what crosses memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tvm import te, tirx

from ..te import analysis, rewrite as te_rewrite
from ..cost import tir_stats
from ..te.program import TEProgram, consumers_of

# The most stages composed into one expression. Composing recurses once per stage (our
# substitution, TVM's simplifier and code generators), so an unbounded chain (thousands of
# element-wise nodes) would exhaust the stack; a cut every 64 stages costs one store and load.
MAX_COMPOSED = 64


@dataclass
class VerticalResult:
    program: TEProgram
    inlined: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)   # stage name -> why it was kept


def _is_index_map(op) -> bool:
    """A stage that only moves data (reshape, transpose, slice, broadcast, pad, concat, gather)."""
    return (op.num_outputs == 1 and analysis.classify(op)[0] != analysis.REDUCTION
            and tir_stats.expr_flops(op.body[0]) == 0)


def _readers(op, users: dict, composed: set) -> list[tuple]:
    """(consumer, the stage it loads) pairs for ``op`` once the index-map stages it feeds are
    composed away."""
    out = []
    # depth-first through the composed stages with a stack of their pending users: a chain of
    # thousands of index-map stages must not recurse as deep
    stack = [(op, iter(users.get(op, [])))]
    while stack:
        producer, pending = stack[-1]
        u = next(pending, None)
        if u is None:
            stack.pop()
        elif u in composed:
            stack.append((u, iter(users.get(u, []))))
        else:
            out.append((u, producer))
    return out


def _effective_reads(op, users: dict, composed: set) -> list[tuple[str, float]]:
    """(consumer, reuse) pairs for ``op`` once the index-map stages it feeds are composed away."""
    return [(u.name, analysis.access_pattern(u, prod, idx)[1]) for u, producer in _readers(op, users, composed)
            for prod, idx in te_rewrite.loads(u.body[0]) if prod.op == producer]


def _selects_into_contractions(stages: list[te.Tensor], users: dict, composed: set) -> dict:
    """{op: reason} for the concatenations a contraction would read as its operand once composed;
    taken from ``composed``, last first, so that of a chain of them (a shift along two axes) only
    the one the contraction reads stays."""
    kept = {}
    for t in reversed(stages):
        op = t.op
        if op not in composed or not analysis.selects_among_loads(op):
            continue
        gemms = [u.name for u, _ in _readers(op, users, composed) if analysis.classify(u)[1] == "contraction"]
        if gemms:
            composed.discard(op)
            kept[op] = (f"selects among {len(te_rewrite.loads(op.body[0]))} loads and {gemms[0]} would read it as "
                        "its operand (a select of loads no GEMM rule tiles: stored once instead)")
    return kept


def _decide(t: te.Tensor, users: dict, pinned: dict, composed: set, flops_per_elem: int) -> str | None:
    """None to inline ``t``; otherwise the reason it stays a stage of its own.

    ``flops_per_elem`` counts the arithmetic of t's body *with its inlined producers composed
    in*; consumers are seen through the index-map stages that are composed away, so a ReLU
    read through a pad by a 3x3 convolution counts as read 9 times.
    """
    op = t.op
    if op in pinned:
        return pinned[op]
    if op.num_outputs != 1:
        return "multi-output compute"
    if analysis.classify(op)[0] == analysis.REDUCTION:
        return "reduction (an anchor)"
    narrowed = analysis.narrowed_reduction(op)
    if narrowed is not None:
        return f"narrows reduction {narrowed}'s float result (its epilogue: the narrow type is written)"
    if op in composed:
        return None
    reads = _effective_reads(op, users, composed)
    for name, reuse in reads:
        if reuse > 1:
            return f"read {reuse:g}x per element by {name} (inlining would repeat its arithmetic)"
    if len(reads) > 1 and flops_per_elem > 2:
        return (f"feeds {len(reads)} consumers ({', '.join(n for n, _ in reads[:3])}); "
                f"{flops_per_elem} ops per element would be repeated")
    return None


def _constant_index(int_constants: dict, tensor: te.Tensor, idx: list):
    """A load of a known integer constant at constant indices is that number: ``take(x, 3)``
    becomes a slice, one-to-one instead of a data-dependent gather."""
    value = int_constants.get(tensor.op)
    if value is None or not str(value.dtype).startswith(("int", "uint")):
        return None
    if not all(isinstance(i, tirx.IntImm) for i in idx):
        return None
    return tirx.const(int(value[tuple(int(i.value) for i in idx)]), str(tensor.dtype))


def vertical(prog: TEProgram) -> VerticalResult:
    """Inline every one-to-one stage that can be composed into its consumers."""
    stages = prog.stages()
    users = consumers_of(stages)
    pinned = {t.op: "model output" for t in prog.outputs}
    for o in prog.opaque:
        for t in o.inputs.values():
            pinned.setdefault(t.op, f"feeds opaque op {o.name}")

    # Index-map stages are composed into their consumers first (unless pinned), so the decision
    # for an arithmetic stage sees the consumers it will really have.
    composed = {t.op for t in stages if t.op not in pinned and _is_index_map(t.op)}
    pinned.update(_selects_into_contractions(stages, users, composed))
    inlined_ops: dict = {}   # old op -> old op (its body is composed on demand)
    int_constants = {t.op: v for t, v in prog.constants.items() if str(v.dtype).startswith(("int", "uint"))}
    new_of: dict = {}        # old op -> list of new tensors
    result = VerticalResult(prog)

    def load_fn(tensor, idx):
        folded = _constant_index(int_constants, tensor, idx)
        if folded is not None:
            return folded
        if tensor.op in inlined_ops:
            return te_rewrite.body_at(tensor.op, tensor.value_index, idx, load_fn)
        if tensor.op in new_of:
            return new_of[tensor.op][tensor.value_index](*idx)
        return None

    names = analysis.stage_names(stages)
    composed_flops: dict = {}
    depth: dict = {}         # op -> stages its expression composes (itself and inlined producers)
    for t in stages:
        op = t.op
        if op in new_of or op in inlined_ops:
            continue
        producers = [p.op for p, _ in te_rewrite.loads(op.body[0]) if p.op in inlined_ops]
        composed_flops[op] = tir_stats.expr_flops(op.body[0]) + sum(composed_flops.get(p, 0) for p in producers)
        depth[op] = 1 + max((depth[p] for p in producers), default=0)
        reason = _decide(t, users, pinned, composed, composed_flops[op])
        if reason is None and depth[op] >= MAX_COMPOSED:
            reason = (f"composes a chain of {depth[op]} stages already (at most {MAX_COMPOSED} per expression: "
                      "deeper ones would exhaust the stack)")
        if reason is None:
            inlined_ops[op] = op
            result.inlined.append(names[op])
        else:
            new_of[op] = te_rewrite.rebuild(op, load_fn)
            result.kept[names[op]] = reason

    def remap(t: te.Tensor) -> te.Tensor:
        return new_of[t.op][t.value_index] if t.op in new_of else t

    op_of = {n.op: prog.op_of.get(old, "?") for old, news in new_of.items() for n in news}
    out = prog.derive(remap, op_of=op_of)
    result.program = out
    return result
