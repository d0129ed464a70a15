"""Horizontal transform: independent stages of the same structure become one batched stage.

Q/K/V projections, LSTM gate blocks, MMoE experts and parallel branches are contractions that
read the same input with weights of the same shape. They are merged into ONE contraction whose
output axis carried by the weights (N) is G times longer, with the weights concatenated along
that axis once, at compile time: [M,K]x[K,N] three times becomes [M,K]x[K,3N], a plain GEMM
that TVM's schedules tile like any other. Consumers read ``merged[..., g*N + n]`` through a
composed index map. Isomorphic element-wise consumers of the same shape (bias adds,
activations) are merged in turn, so each branch's epilogue stays fused with the merged GEMM.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import tvm_ffi
from tvm import te, tirx

from ..te import analysis, rewrite as te_rewrite
from ..te.program import TEProgram, consumers_of


@dataclass
class HorizontalResult:
    program: TEProgram
    merged: list[list[str]] = field(default_factory=list)   # names of each merged set
    skipped: dict[str, str] = field(default_factory=dict)    # first candidate -> why not merged


@dataclass
class _MergeSet:
    level: list                 # the isomorphic ops, in slot order
    axis: int                   # the output axis the branches are concatenated along
    stacked: dict               # branch-0 weight op -> (concatenated placeholder, its axis)
    tensor: te.Tensor | None = None

    @property
    def extent(self) -> int:
        return int(self.level[0].axis[self.axis].dom.extent)


def _canonical_body(op, mapping: dict, axes: list):
    """op's body over shared axis variables, fresh reduce variables, inputs renamed by ``mapping``."""
    def load_fn(tensor, idx):
        rep = mapping.get(tensor.op)
        return rep(*idx) if rep is not None else None

    vmap = {ax.var: a for ax, a in zip(op.axis, axes)}
    vmap.update({rv.var: tirx.Var(f"r{i}", rv.var.ty) for i, rv in enumerate(op.reduce_axis)})
    return te_rewrite.substitute(op.body[0], vmap, load_fn)


def _same_function(a, b, axes: list) -> bool:
    """Equal up to the (body-local) reduce variables; the shared axes must match one for one."""
    if not tvm_ffi.structural_equal(a, b, map_free_vars=True):
        return False
    order = lambda e: [v.name for v in te_rewrite.variables(e) if any(v.same_as(x) for x in axes)]  # noqa: E731
    return order(a) == order(b)


def _isomorphic(ops: list, weights: set, merged: dict) -> dict | None:
    """If the ops compute one function of shared inputs, differing only in same-shaped weights
    (or in the slot of an already merged level they read), return per op its differing inputs."""
    first = ops[0]
    shape = [int(a.dom.extent) for a in first.axis]
    if any(o.num_outputs != 1 or [int(a.dom.extent) for a in o.axis] != shape
           or len(o.reduce_axis) != len(first.reduce_axis) for o in ops):
        return None
    inputs = [{x.op for x in o.input_tensors} for o in ops]
    common = set.intersection(*inputs)
    roles = [sorted(ins - common, key=lambda op: op.name) for ins in inputs]
    if any(len(r) != len(roles[0]) or not all(d in weights or d in merged for d in r) for r in roles):
        return None
    axes = [tirx.Var(f"a{i}", ax.var.ty) for i, ax in enumerate(first.axis)]
    ref = _canonical_body(first, {}, axes)
    for o, r in zip(ops[1:], roles[1:]):
        mapping = {d: next(x for x in first.input_tensors if x.op == d0) for d, d0 in zip(r, roles[0])}
        if not _same_function(_canonical_body(o, mapping, axes), ref, axes):
            return None
    return dict(zip(ops, roles))


def horizontal(prog: TEProgram, min_branches: int = 2) -> HorizontalResult:
    """Merge sets of isomorphic contractions that read one shared input (and their epilogues)."""
    stages = prog.stages()
    users = consumers_of(stages)
    weights = {t.op for t in prog.weights}
    values = prog.weight_values
    result = HorizontalResult(prog)

    # Seeds: contractions with one shared data input, bucketed by output and weight shapes
    # (MMoE's experts and its gates read the same features but are two different sets).
    seeds = defaultdict(list)
    for t in stages:
        kind, detail, _ = analysis.classify(t.op)
        data = [x.op for x in t.op.input_tensors if x.op not in weights]
        if kind == analysis.REDUCTION and detail == "contraction" and len(data) == 1:
            wshapes = sorted(tuple(int(d) for d in x.shape) for x in t.op.input_tensors if x.op in weights)
            seeds[(data[0], tuple(int(d) for d in t.shape), tuple(wshapes))].append(t.op)

    merged_of: dict = {}        # old op -> (merge set, slot)
    new_values: dict = {}
    sets: list[_MergeSet] = []
    for ops in seeds.values():
        level = [o for o in ops if o not in merged_of]
        axis = _weight_axis(level[0], weights) if level else None
        if len(level) >= min_branches and axis is None:
            result.skipped[level[0].name] = "no output axis is carried by the weights alone"
            continue
        while len(level) >= min_branches:
            roles = _isomorphic(level, weights, merged_of)
            if roles is None:
                result.skipped[level[0].name] = f"{len(level)} candidates are not isomorphic"
                break
            if any(d in weights and d not in values for o in level for d in roles[o]):
                result.skipped[level[0].name] = "weight values unknown (cannot concatenate at compile time)"
                break
            ms = _plan(level, roles, merged_of, axis, new_values, values)
            if ms is None:
                result.skipped[level[0].name] = "a weight does not vary along the merged axis"
                break
            sets.append(ms)
            merged_of.update({o: (ms, slot) for slot, o in enumerate(level)})
            result.merged.append([o.name for o in level])
            nxt = [users.get(o, []) for o in level]
            if not all(len(u) == 1 for u in nxt) or len({u[0] for u in nxt}) != len(level):
                break
            level = [u[0] for u in nxt]
            # Follow element-wise epilogues of the same shape only; index maps are the vertical
            # transform's business (they compose into consumers, merged or not).
            if any(analysis.classify(o)[0] == analysis.REDUCTION or o.num_outputs != 1
                   or [int(a.dom.extent) for a in o.axis] != [int(a.dom.extent) for a in ms.level[0].axis]
                   for o in level):
                break

    if not sets:
        return result
    stacked = [ph for ms in sets for ph, _ in ms.stacked.values()]
    result.program = _rebuild(prog, stages, merged_of, stacked, new_values)
    return result


def _weight_axis(op, weights: set) -> int | None:
    """The last output axis that indexes a weight operand and no data operand (GEMM's N)."""
    data_vars, weight_vars = set(), set()
    for t, idx in te_rewrite.loads(op.body[0]):
        target = weight_vars if t.op in weights else data_vars
        for i in idx:
            tvm_ffi.structural_walk(i, (tirx.Var, lambda v, tg=target: tg.add(v.name)))
    for a in reversed(range(len(op.axis))):
        name = op.axis[a].var.name
        if name in weight_vars and name not in data_vars and int(op.axis[a].dom.extent) > 1:
            return a
    return None


def _plan(level, roles, merged_of, axis, new_values, values) -> _MergeSet | None:
    """Concatenate the branches' differing weights along the axis their index carries ``axis``."""
    first, n = level[0], len(level)
    var = first.axis[axis].var
    stacked = {}
    for k, d0 in enumerate(roles[first]):
        if d0 in merged_of:
            continue
        w0 = next(x for x in first.input_tensors if x.op == d0)
        positions = {p for t, idx in te_rewrite.loads(first.body[0]) if t.op == d0
                     for p, i in enumerate(idx) if isinstance(i, tirx.Var) and i.same_as(var)}
        if len(positions) != 1:
            return None
        p = positions.pop()
        arr = np.concatenate([values[roles[o][k]] for o in level], axis=p)
        shape = [int(d) for d in w0.shape]
        shape[p] *= n
        ph = te.placeholder(shape, w0.dtype, name=f"{d0.name}_h{n}")
        new_values[ph.op] = arr
        stacked[d0] = (ph, p)
    return _MergeSet(level, axis, stacked)


def _build_merged(ms: _MergeSet, merged_of: dict, outer_load) -> te.Tensor:
    """One stage computing all of ``ms.level``, concatenated along ``ms.axis``."""
    first, n, ext = ms.level[0], len(ms.level), ms.extent

    def fcompute(*idx):
        j = idx[ms.axis]
        local = list(idx)
        local[ms.axis] = tirx.floormod(j, ext)

        def load_fn(tensor, index):
            if tensor.op in ms.stacked:
                ph, p = ms.stacked[tensor.op]
                index = list(index)
                index[p] = j
                return ph(*index)
            if tensor.op in merged_of:             # the previous merged level: same position j
                index = list(index)
                index[ms.axis] = j
                return merged_of[tensor.op][0].tensor(*index)
            return outer_load(tensor, index)
        return te_rewrite.body_at(first, 0, local, load_fn)

    shape = [ax.dom.extent for ax in first.axis]
    shape[ms.axis] = shape[ms.axis] * n
    return te.compute(shape, fcompute, name=f"{first.name}_h{n}", tag=first.tag)


def _slot_index(ms: _MergeSet, slot: int, idx: list) -> list:
    idx = list(idx)
    idx[ms.axis] = idx[ms.axis] + tirx.const(slot * ms.extent, idx[ms.axis].ty if hasattr(idx[ms.axis], "ty") else "int64")
    return idx


def _rebuild(prog, stages, merged_of, new_weights, new_values) -> TEProgram:
    new_of: dict = {}

    def load_fn(tensor, idx):
        if tensor.op in merged_of:
            ms, slot = merged_of[tensor.op]
            return ms.tensor(*_slot_index(ms, slot, idx))
        if tensor.op in new_of:
            return new_of[tensor.op][tensor.value_index](*idx)
        return None

    for t in stages:   # topological: producers are rebuilt (or merged) before their consumers
        if t.op in merged_of:
            ms = merged_of[t.op][0]
            if ms.tensor is None:
                ms.tensor = _build_merged(ms, merged_of, load_fn)
        elif t.op not in new_of:
            new_of[t.op] = te_rewrite.rebuild(t.op, load_fn)

    def remap(t):
        if t.op in merged_of:
            ms, slot = merged_of[t.op]
            return te.compute(t.shape, lambda *i: ms.tensor(*_slot_index(ms, slot, list(i))), name=f"{t.op.name}_out")
        return new_of[t.op][t.value_index] if t.op in new_of else t

    return prog.derive(remap, prog.weights + new_weights, {**prog.weight_values, **new_values}).prune_weights()
