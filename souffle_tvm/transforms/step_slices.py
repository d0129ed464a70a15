"""Step slices moved to where the step was made: ``take(f(concat(x_0 .. x_n)), t)`` becomes
``f(x_t)`` wherever ``f`` works row by row along the concatenated axis.

A stacked recurrence exported layer by layer concatenates layer l's per-step outputs into its
sequence, runs layer l+1's input projection over the whole sequence as one matmul, and takes
step t's row back out. Step t of layer l+1 then depends on *every* step of layer l: the cells
cannot form waves (``stitch.waves``), and the layers run one after another. Taking the row
before the matmul instead makes step t of layer l+1 read only step t of layer l: the
dependence is the cell graph's, (l, t) on (l-1, t) and (l, t-1).

Nothing here knows about recurrences: a ``take`` of one index along an axis moves through the
ops that treat that axis as rows (element-wise ops with broadcasting, ``matmul`` over a batch
or row axis of its left operand, ``expand_dims``, ``squeeze``, ``concat`` along another axis of
one piece) until it meets a ``concat`` along that axis, and is rewritten only where it does: a
take from a tensor made whole (an input's projection for all steps at once) stays, one matmul
being better than n. What the rewrite leaves unused (the whole-sequence matmul) is removed.
"""

from __future__ import annotations

import tvm
from tvm import relax

R = relax.op
_UNARY = {"relax.sigmoid", "relax.tanh", "relax.exp", "relax.negative", "relax.nn.relu", "relax.abs", "relax.sqrt",
          "relax.clip", "relax.nn.leakyrelu", "relax.log", "relax.erf", "relax.nn.gelu", "relax.astype"}
_BINARY = {"relax.add", "relax.subtract", "relax.multiply", "relax.divide"}


def _op(expr) -> str | None:
    return expr.op.name if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) else None


def _shape(expr) -> list[int] | None:
    shape = getattr(expr.ty, "shape", None)
    if shape is None or any(not isinstance(d, tvm.tirx.IntImm) for d in shape):
        return None
    return [int(d) for d in shape]


def _ints(attr) -> list[int]:
    return [int(a) for a in attr] if attr is not None else []


def _take_of_step(expr) -> tuple[relax.Expr, int, int] | None:
    """(tensor, axis, index) when ``expr`` takes one constant index along one axis."""
    if _op(expr) != "relax.take" or not isinstance(expr.args[1], tvm.ir.GenericConst):
        return None
    index = expr.args[1].value.numpy()
    shape = _shape(expr.args[0])
    if index.ndim != 0 or shape is None or expr.attrs.axis is None:
        return None
    axis = int(expr.attrs.axis) % len(shape)
    return expr.args[0], axis, int(index) % shape[axis]


@relax.expr_functor.mutator
class _Sinker(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, values: dict):
        super().__init__(mod)
        self.values = values
        self.sunk = 0

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        step = _take_of_step(binding.value)
        if step is not None and self._reaches_concat(*step):
            new = self._sliced(*step)
            self.sunk += 1
            self.set_var_remap(binding.var, self.builder_.emit(new, binding.var.name))
            return
        super().visit_var_binding_(binding)

    def _value(self, x):
        return self.values.get(x) if isinstance(x, relax.Var) else None

    def _reaches_concat(self, x, axis: int, index: int) -> bool:
        """Whether the take meets a ``concat`` along its axis through row-wise ops only."""
        v = self._value(x)
        step = self._through(x, axis, index)
        if _op(v) == "relax.concat" and int(v.attrs.axis) % len(_shape(x)) == axis:
            return True
        return step is not None and step[0][0] is not None and self._reaches_concat(*step[0])

    def _through(self, x, axis: int, index: int):
        """How the take moves through ``x``'s op: ((operand, axis, index) to follow, rebuild),
        ``rebuild`` making the op again from its sliced operand; None where it cannot."""
        v, shape = self._value(x), _shape(x)
        if v is None or shape is None:
            return None
        op = _op(v)
        if op in _UNARY:
            return (v.args[0], axis, index), lambda a: relax.Call(v.op, [a] + list(v.args[1:]), v.attrs)
        if op == "relax.expand_dims":
            axes = sorted(a % len(shape) for a in _ints(v.attrs.axis))
            rest = [a - (a > axis) for a in axes if a != axis]
            if axis in axes:      # the inserted axis itself: the take undoes it
                return (None, None, None), lambda _a: (R.expand_dims(self.visit_expr(v.args[0]), rest) if rest
                                                       else self.visit_expr(v.args[0]))
            inner = axis - sum(a < axis for a in axes)
            return (v.args[0], inner, index), lambda a: R.expand_dims(a, rest)
        if op == "relax.squeeze":
            in_shape = _shape(v.args[0])
            axes = sorted(a % len(in_shape) for a in _ints(v.attrs.axis)) if v.attrs.axis is not None else \
                [i for i, d in enumerate(in_shape) if d == 1]
            inner = [i for i in range(len(in_shape)) if i not in axes][axis]
            return (v.args[0], inner, index), lambda a: R.squeeze(a, [b - (b > inner) for b in axes])
        if op == "relax.concat":
            fields = list(v.args[0].fields) if isinstance(v.args[0], relax.Tuple) else None
            if fields is None:
                return None
            along = int(v.attrs.axis) % len(shape)
            if along != axis:
                if len(fields) != 1:
                    return None
                return (fields[0], axis, index), lambda a: a
            start = 0
            for f in fields:
                size = _shape(f)[axis]
                if index < start + size:
                    return (f, axis, index - start), lambda a: a
                start += size
            return None
        if op == "relax.matmul":
            a, b = v.args
            ra, rb = len(_shape(a)), len(_shape(b))
            if rb != 2 or ra < 2 or axis >= ra - 1:
                return None       # a batched right operand, or the take is along its columns
            return (a, axis, index), lambda s: R.matmul(s, self.visit_expr(b), v.attrs.out_dtype)
        if op in _BINARY:
            return self._binary(v, shape, axis, index)
        return None

    def _binary(self, v, shape: list[int], axis: int, index: int):
        """An element-wise op with broadcasting: each operand taken along its own axis."""
        lhs, rhs = v.args
        follow = []
        for operand in (lhs, rhs):
            s = _shape(operand)
            if s is None:
                return None
            at = axis - (len(shape) - len(s))
            follow.append((operand, at, index if at >= 0 and s[at] != 1 else 0))
        main = max(range(2), key=lambda k: follow[k][1] >= 0 and _shape(follow[k][0])[follow[k][1]] != 1)
        other = follow[1 - main]

        def rebuild(sliced):
            o, at, i = other
            side = self.visit_expr(o) if at < 0 else self._sliced_or_taken(o, at, i)
            args = [sliced, side] if main == 0 else [side, sliced]
            return relax.Call(v.op, args, v.attrs)
        return follow[main], rebuild

    def _sliced(self, x, axis: int, index: int) -> relax.Expr:
        step = self._through(x, axis, index)
        (inner, at, i), rebuild = step
        if inner is None:
            return rebuild(None)
        return rebuild(self._sliced_or_taken(inner, at, i))

    def _sliced_or_taken(self, x, axis: int, index: int) -> relax.Expr:
        """``x`` at ``index`` along ``axis`` (removed): moved up to a concat where it reaches one,
        else a take of ``x`` as it is."""
        step = self._through(x, axis, index)
        if step is not None and step[0][0] is None:     # an inserted axis: the take undoes it
            return step[1](None)
        if self._reaches_concat(x, axis, index):
            return self.builder_.emit(self._sliced(x, axis, index))
        return R.take(self.visit_expr(x), relax.const(index, "int64"), axis=axis)


def sink(mod: tvm.IRModule) -> tuple[tvm.IRModule, int]:
    """``mod`` with every step take that reaches a concat moved to it, and how many moved."""
    main = mod["main"]
    values = {b.var: b.value for blk in main.body.blocks for b in blk.bindings if isinstance(b, relax.VarBinding)}
    sinker = _Sinker(mod, values)
    new = sinker.visit_expr(main)
    if not sinker.sunk:
        return mod, 0
    out = mod.shallow_copy() if hasattr(mod, "shallow_copy") else tvm.IRModule(dict(mod.functions), attrs=mod.attrs)
    out["main"] = new
    return relax.transform.DeadCodeElimination(["main"])(out), sinker.sunk
