"""Rewriting TE stages: substitute axis variables and tensor loads, then rebuild the compute.

This is how index maps are *composed*: inlining a one-to-one producer P into a consumer C
replaces each load ``P[f(i)]`` in C by P's body with P's axes bound to ``f(i)``, and the
composed index expressions are simplified over C's iteration domain.
"""

from __future__ import annotations

from typing import Callable

import tvm
import tvm_ffi
from tvm import te, tirx

LoadFn = Callable[[te.Tensor, list], "tvm.ir.PrimExpr | None"]


def is_load(node) -> bool:
    return isinstance(node, tvm.ir.Call) and getattr(node.op, "name", "") == "te.tensor_load"


def loads(expr) -> list[tuple[te.Tensor, list]]:
    """Every (tensor, indices) load in an expression, in visit order."""
    found = []

    def visit(c):
        if is_load(c):
            found.append((c.args[0], list(c.args[1:])))

    tvm_ffi.structural_walk(expr, (tvm.ir.Call, visit))
    return found


def variables(node) -> list:
    """Every Var occurrence in ``node``, in visit order."""
    found: list = []
    tvm_ffi.structural_walk(node, (tirx.Var, lambda v: found.append(v)))
    return found


def uses(node, vars_) -> bool:
    """Does ``node`` use any of ``vars_`` (a set or list; TVM objects hash and compare by identity)?"""
    wanted = set(vars_)
    return any(v in wanted for v in variables(node))


def dtype_of(e) -> str:
    """An expression's dtype (TVM 0.27 keeps it in ``ty``; TE tensors in ``dtype``)."""
    return str(e.ty) if hasattr(e, "ty") else str(e.dtype)


def unify_index_dtypes(idx: list) -> list:
    """One dtype per buffer access (TIR requires it): widen to int64 when mixed."""
    kinds = {dtype_of(i) for i in idx}
    if len(kinds) <= 1:
        return idx
    return [i if dtype_of(i) == "int64" else tirx.Cast("int64", i) for i in idx]


def cast_like(value, like):
    """``value`` cast to ``like``'s dtype where they differ."""
    return value if dtype_of(value) == dtype_of(like) else tirx.Cast(dtype_of(like), value)


def simplify(analyzer: tvm.sym.Analyzer, expr):
    """``analyzer.simplify(expr)``, or ``expr`` unchanged where it cannot be simplified.

    An index holding a load (a gather: embedding ids, masks) can reach a canonical-simplifier
    path that hashes the load structurally, which ``te.PlaceholderOp`` does not support
    (TypeError); such an index is still correct unsimplified.
    """
    try:
        return analyzer.simplify(expr)
    except TypeError:
        if not loads(expr):
            raise
        return expr


def substitute(expr, vmap: dict, load_fn: LoadFn | None = None, analyzer: tvm.sym.Analyzer | None = None):
    """Replace variables by ``vmap`` and loads by ``load_fn(tensor, indices)`` (None keeps the load).

    ``load_fn`` may itself call ``substitute`` (inlining chains): no structural_map is ever
    entered from inside another one's callback, which the FFI does not support.
    """
    if vmap:
        expr = tvm_ffi.structural_map(expr, (tirx.Var, lambda v: vmap.get(v, v)))
    if load_fn is None and analyzer is None:
        return expr
    calls = []
    tvm_ffi.structural_walk(expr, (tvm.ir.Call, lambda c: calls.append(c) if is_load(c) else None))
    if not calls:
        return expr
    replacement: dict[int, list] = {}
    for c in calls:
        tensor = c.args[0]
        idx = [substitute(i, {}, load_fn, analyzer) for i in c.args[1:]]   # gathers: loads in indices
        if analyzer is not None:
            idx = unify_index_dtypes([simplify(analyzer, i) for i in idx])
        new = load_fn(tensor, idx) if load_fn is not None else None
        replacement.setdefault(hash(c), []).append((c, new if new is not None else tensor(*idx)))

    def swap(c):
        for orig, new in replacement.get(hash(c), ()):
            if orig.same_as(c):
                return new
        return c

    return tvm_ffi.structural_map(expr, (tvm.ir.Call, swap), order="pre")


def body_at(op: te.ComputeOp, value_index: int, indices: list, load_fn: LoadFn | None = None,
            analyzer: tvm.sym.Analyzer | None = None):
    """The expression ``op`` computes for output ``value_index`` at ``indices`` (inlining it)."""
    vmap = {ax.var: cast_like(i, ax.var) for ax, i in zip(op.axis, indices)}
    return substitute(op.body[value_index], vmap, load_fn, analyzer)


def rebuild(op: te.ComputeOp, load_fn: LoadFn, name: str | None = None) -> list[te.Tensor]:
    """A new compute with the same iteration space whose loads go through ``load_fn``."""
    shape = [ax.dom.extent for ax in op.axis]

    def fcompute(*idx):
        ana = tvm.sym.Analyzer()
        # Unit axes are left unbound: simplified to 0 they would make an epilogue's load
        # non-trivial (``out[0, i]`` instead of ``out[v0, i]``), which dlight cannot inline.
        for v, ax in zip(idx, op.axis):
            if not (hasattr(ax.dom.extent, "value") and ax.dom.extent.value == 1):
                ana.bind(v, tvm.ir.Range(0, ax.dom.extent))
        for rv in op.reduce_axis:
            ana.bind(rv.var, rv.dom)
        vmap = {ax.var: cast_like(v, ax.var) for ax, v in zip(op.axis, idx)}
        bodies = [substitute(b, vmap, load_fn) for b in op.body]
        # Composed loads come back unsimplified; simplify every index over this domain once.
        bodies = [substitute(b, {}, None, ana) for b in bodies]
        if len(bodies) > 1 and all(isinstance(b, tvm.tirx.Reduce) for b in bodies):
            # a tuple reduction (argmax's value and index): TE wants its outputs to share ONE
            # source, as the original did, not equal copies of it
            r = bodies[0]
            init = list(r.init) if r.init else None
            bodies = [tvm.tirx.Reduce(r.combiner, r.source, r.axis, r.condition, i, init) for i in range(len(bodies))]
        return bodies if len(bodies) > 1 else bodies[0]

    out = te.compute(shape, fcompute, name=name or op.name, tag=op.tag, attrs=op.attrs)
    return list(out) if isinstance(out, (list, tuple)) else [out]
