"""Vertical transform: compose chains of one-to-one stages into their consumers.

A one-to-one stage P is *inlined*: each load ``P[f(i)]`` in a consumer becomes P's body at
``f(i)``, so P's index map is composed with the consumer's (a reshape → transpose chain
becomes one index expression, simplified over the consumer's domain). P then no longer exists.

P is kept, with a recorded reason, when inlining would change what runs or repeat work:
it is a model output or feeds an opaque op; or it does arithmetic and some consumer reads
each of its elements more than once (a GEMM reading a GELU output would recompute it
per output column) — such a stage stays and becomes its producer's *epilogue* in the
partition (fused at its store, computed once).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tvm import te

from .. import analysis, te_rewrite, tir_stats
from ..te_program import TEProgram


@dataclass
class VerticalResult:
    program: TEProgram
    inlined: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)   # stage name -> why it was kept


def _consumers(prog: TEProgram, stages: list[te.Tensor]) -> dict:
    users: dict = {t.op: [] for t in stages}
    for t in stages:
        for inp in {x.op for x in t.op.input_tensors}:
            users.setdefault(inp, []).append(t.op)
    return users


def _decide(t: te.Tensor, users: list, pinned: dict, flops_per_elem: int) -> str | None:
    """None to inline ``t``; otherwise the reason it stays a stage of its own.

    ``flops_per_elem`` counts the arithmetic of t's body *with its inlined producers composed
    in*, so a bias add hidden behind a reshape still counts when the chain meets a GEMM.
    """
    op = t.op
    if op in pinned:
        return pinned[op]
    if op.num_outputs != 1:
        return "multi-output compute"
    kind, _, _ = analysis.classify(op)
    if kind == analysis.REDUCTION:
        return "reduction (an anchor)"
    if flops_per_elem == 0:
        return None  # a pure index map (reshape/transpose/slice/broadcast/pad/concat/gather): compose it
    for u in users:
        for prod, idx in te_rewrite.loads(u.body[0]):
            if prod.op == op:
                _, reuse, _ = analysis.access_pattern(u, prod, idx)
                if reuse > 1:
                    return f"read {reuse:g}x per element by {u.name} (inlining would repeat its arithmetic)"
    if len(users) > 1 and flops_per_elem > 2:
        return f"feeds {len(users)} consumers ({', '.join(u.name for u in users[:3])}); {flops_per_elem} ops per element would be repeated"
    return None


def vertical(prog: TEProgram) -> VerticalResult:
    """Inline every one-to-one stage that can be composed into its consumers."""
    stages = prog.stages()
    users = _consumers(prog, stages)
    pinned = {t.op: "model output" for t in prog.outputs}
    for o in prog.opaque:
        for t in o.inputs.values():
            pinned.setdefault(t.op, f"feeds opaque op {o.name}")

    inlined_ops: dict = {}   # old op -> old op (its body is composed on demand)
    new_of: dict = {}        # old op -> list of new tensors
    result = VerticalResult(prog)

    def load_fn(tensor, idx):
        if tensor.op in inlined_ops:
            return te_rewrite.body_at(tensor.op, tensor.value_index, idx, load_fn)
        if tensor.op in new_of:
            return new_of[tensor.op][tensor.value_index](*idx)
        return None

    composed_flops: dict = {}
    for t in stages:
        op = t.op
        if op in new_of or op in inlined_ops:
            continue
        composed_flops[op] = tir_stats.expr_flops(op.body[0]) + sum(
            composed_flops.get(p.op, 0) for p, _ in te_rewrite.loads(op.body[0]) if p.op in inlined_ops)
        reason = _decide(t, users.get(op, []), pinned, composed_flops[op])
        if reason is None:
            inlined_ops[op] = op
            result.inlined.append(op.name)
        else:
            new_of[op] = te_rewrite.rebuild(op, load_fn)
            result.kept[op.name] = reason

    def remap(t: te.Tensor) -> te.Tensor:
        return new_of[t.op][t.value_index] if t.op in new_of else t

    out = TEProgram(prog.inputs, prog.weights, [remap(t) for t in prog.outputs], dict(prog.constants),
                    [], {})
    for o in prog.opaque:
        out.opaque.append(type(o)(o.name, o.call, {v: remap(t) for v, t in o.inputs.items()}, o.outputs, o.reason))
    for old, news in new_of.items():
        for n in news:
            out.op_of[n.op] = prog.op_of.get(old, "?")
    result.program = out
    return result
