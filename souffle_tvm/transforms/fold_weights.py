"""Fold weight-only stages at compile time.

Exporters put weight layout work in the graph (Gemm's ``transB`` becomes a transpose of the
weight, a conv bias is reshaped to [1, C, 1, 1]). Such stages depend on weights alone, so
they are evaluated once here (one llvm build for all of them) and replaced by new weights:
no kernel runs them per inference, and contractions then read a weight directly, which is
what lets the horizontal transform see MMoE experts as isomorphic.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import tvm
from tvm import te

from ..core.structural import ByStructure
from ..te import rewrite as te_rewrite
from ..te.program import TEProgram


@dataclass
class FoldResult:
    program: TEProgram
    folded: list[str] = field(default_factory=list)


def fold_weights(prog: TEProgram) -> FoldResult:
    stages = prog.stages()
    known = {w.op for w in prog.weights if w.op in prog.weight_values} | {c.op for c in prog.constants}
    weight_only = set()
    for t in stages:
        if all(x.op in known or x.op in weight_only for x in t.op.input_tensors) and t.op.input_tensors:
            weight_only.add(t.op)
    frontier = []
    for t in stages:
        if t.op in weight_only:
            continue
        for x in t.op.input_tensors:
            if x.op in weight_only and not any(x.op.same_as(f.op) and x.value_index == f.value_index for f in frontier):
                frontier.append(x)
    # what opaque ops read counts too: a weight-only stage left for them alone would be a kernel
    # of constant arguments, which TVM's FoldConstant then runs on the host (a CUDA PrimFunc fails)
    for t in list(prog.outputs) + [t for o in prog.opaque for t in o.inputs.values()]:
        if t.op in weight_only and not any(t.op.same_as(f.op) and t.value_index == f.value_index for f in frontier):
            frontier.append(t)
    if not frontier:
        return FoldResult(prog)

    values = _evaluate(prog, frontier)
    folded = {}
    new_weights = []
    for t, v in zip(frontier, values):
        ph = te.placeholder(t.shape, t.dtype, name=f"{t.op.name}_folded")
        folded[(t.op, t.value_index)] = ph
        new_weights.append(ph)

    new_of: dict = {}

    def load_fn(tensor, idx):
        key = (tensor.op, tensor.value_index)
        if key in folded:
            return folded[key](*idx)
        if tensor.op in new_of:
            return new_of[tensor.op][tensor.value_index](*idx)
        return None

    for t in stages:
        if t.op not in weight_only and t.op not in new_of:
            new_of[t.op] = te_rewrite.rebuild(t.op, load_fn)

    def remap(t):
        key = (t.op, t.value_index)
        if key in folded:
            return folded[key]
        return new_of[t.op][t.value_index] if t.op in new_of else t

    values_map = {**prog.weight_values, **{ph.op: v for ph, v in zip(new_weights, values)}}
    out = prog.derive(remap, list(prog.weights) + new_weights, values_map).prune_weights()
    return FoldResult(out, [t.op.name for t in frontier])


def _evaluate(prog: TEProgram, frontier: list[te.Tensor]) -> list[np.ndarray]:
    """Compute the frontier tensors from the weight values with one CPU build.

    One PrimFunc per frontier tensor, built once per structurally distinct one, in one module:
    LLVM's time on a single function grows faster than its size (ResNeXt's 105 bias reshapes
    as one function: 7-9 s; as 105: 1.8 s; as the 7 distinct ones, each looked up once: 0.15 s)."""
    weights = [w for w in prog.weights if w.op in prog.weight_values] + list(prog.constants)
    consts = {t.op: v for t, v in prog.constants.items()}
    funcs: dict[str, tvm.tirx.PrimFunc] = {}
    distinct = ByStructure()

    def add(func: tvm.tirx.PrimFunc) -> str:
        name = f"fold{len(funcs)}"
        funcs[name] = func.with_attr("global_symbol", name)
        return name

    name_of, inputs_of = [], []
    for t in frontier:
        needed = _reachable_placeholders([t])
        inputs = [w for w in weights if w.op in needed]
        func = te.create_prim_func(inputs + [t])
        name_of.append(distinct(func, lambda: add(func)))
        inputs_of.append(inputs)
    lib = tvm.compile(tvm.IRModule(funcs), target="llvm")
    compiled = {name: lib[name] for name in funcs}     # each lookup costs ~13 ms: once per function
    arrays: dict = {}

    def array(w):
        if w.op not in arrays:
            arrays[w.op] = tvm.runtime.tensor(prog.weight_values[w.op] if w.op in prog.weight_values
                                              else consts[w.op])
        return arrays[w.op]

    values = []
    for t, name, inputs in zip(frontier, name_of, inputs_of):
        out = tvm.runtime.tensor(np.zeros([int(d) for d in t.shape], str(t.dtype)))
        compiled[name](*[array(w) for w in inputs], out)
        values.append(out.numpy())
    return values


def _reachable_placeholders(tensors) -> set:
    seen, stack, found = set(), [t.op for t in tensors], set()
    while stack:
        op = stack.pop()
        if op in seen:
            continue
        seen.add(op)
        if isinstance(op, te.PlaceholderOp):
            found.add(op)
        stack.extend(x.op for x in op.input_tensors)
    return found
