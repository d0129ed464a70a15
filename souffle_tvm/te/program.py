"""Lowering: a Relax module → one TEProgram, the whole model as a DAG of TE stages.

Every operator becomes the TE stages of its own TVM definition: its ``FLegalize`` function is
called with ``BlockBuilder.call_te`` intercepted, so the topi compute it would have wrapped in
a PrimFunc is returned as ``te.Tensor`` s connected to the tensors of earlier bindings. Weights
are placeholders. An operator whose legalization does not reduce to TE (a packed call, a
shape computation, a missing FLegalize) becomes an *opaque* stage that later runs through
TVM's default path; it is listed, never fatal.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import tvm
import tvm_ffi
from tvm import relax, te

from . import from_primfunc
from ..errors import LoweringError


_INTERNAL_KWARGS = ("primfunc_name_hint", "primfunc_attrs")


@dataclass
class OpaqueStage:
    """A binding kept as a Relax call; its results enter the TE DAG as placeholders."""

    name: str
    call: relax.Call
    inputs: dict              # relax.Var (argument of ``call``) -> te.Tensor it stands for
    outputs: list[te.Tensor]  # placeholders for the call's results (one per tuple field)
    reason: str
    # functions of the imported module the call names (``call_tir``'s PrimFunc): name -> function,
    # re-added to the module the call is emitted into
    callees: dict = field(default_factory=dict)


@dataclass
class TEProgram:
    """The whole model as TE: ``outputs`` computed from ``inputs`` and ``weights``.

    ``constants`` holds values of weight-like placeholders that came from Relax constants
    (scalars and small tensors the importer folded); ``weights`` are the Relax function's
    parameters after the model inputs, in order.
    """

    inputs: list[te.Tensor]
    weights: list[te.Tensor]
    outputs: list[te.Tensor]
    constants: dict = field(default_factory=dict)   # te.Tensor -> np.ndarray
    opaque: list[OpaqueStage] = field(default_factory=list)
    op_of: dict = field(default_factory=dict)       # te.Operation -> relax op name it came from
    weight_values: dict = field(default_factory=dict)  # weight te.Operation -> np.ndarray (when known)

    def weight_arrays(self) -> list:
        """The weights' values in ``weights`` order (what the emitted ``main`` takes after inputs)."""
        return [self.weight_values[w.op] for w in self.weights]

    def derive(self, remap, weights: list | None = None, values: dict | None = None,
               op_of: dict | None = None) -> "TEProgram":
        """The transformed program whose tensors are ``remap(old tensor)`` (outputs and the
        inputs of opaque ops), over the same inputs and constants."""
        opaque = [OpaqueStage(o.name, o.call, {v: remap(t) for v, t in o.inputs.items()}, o.outputs, o.reason,
                              o.callees) for o in self.opaque]
        return TEProgram(self.inputs, list(self.weights if weights is None else weights),
                         [remap(t) for t in self.outputs], dict(self.constants), opaque,
                         dict(self.op_of if op_of is None else op_of),
                         dict(self.weight_values if values is None else values))

    def prune_weights(self) -> "TEProgram":
        """Drop weights nothing reads any more (a stage, an output or an opaque op); in place."""
        used = ({x.op for t in self.stages() for x in t.op.input_tensors} | {t.op for t in self.outputs}
                | {t.op for o in self.opaque for t in o.inputs.values()})
        self.weights = [w for w in self.weights if w.op in used]
        return self

    def stages(self) -> list[te.Tensor]:
        """Every compute tensor reachable from the outputs, producers before consumers."""
        order, seen = [], set()
        roots = list(self.outputs) + [t for o in self.opaque for t in o.inputs.values()]
        # An opaque op's results depend on its inputs: visit those first.
        after = {out.op: list(o.inputs.values()) for o in self.opaque for out in o.outputs}
        for root in roots:  # iterative post-order: models are thousands of stages deep
            stack = [(root.op, False)]
            while stack:
                op, expanded = stack.pop()
                if expanded:
                    if isinstance(op, te.ComputeOp):
                        order.extend(op.output(i) for i in range(op.num_outputs))
                    continue
                if op in seen:
                    continue
                seen.add(op)
                stack.append((op, True))
                deps = list(op.input_tensors) + after.get(op, [])
                stack.extend((t.op, False) for t in reversed(deps) if t.op not in seen)
        return order

    def placeholders(self) -> list[te.Tensor]:
        return list(self.inputs) + list(self.weights) + list(self.constants)


# -- capture -------------------------------------------------------------------------------------
class _Capture:
    """Converts relax arguments to TE while FLegalize runs, and records new constants."""

    def __init__(self):
        self.env: dict = {}
        self.constants: dict = {}

    def to_te(self, a):
        if isinstance(a, (list, tuple, tvm_ffi.Array)):
            return [self.to_te(x) for x in a]
        if isinstance(a, te.Tensor) or not isinstance(a, tvm.ir.Expr) or tvm.ir.is_prim_expr(a):
            return a
        if isinstance(a, tvm.ir.GenericConst):
            if a not in self.env:
                value = a.value.numpy()
                t = te.placeholder(_i64(int(x) for x in a.ty.shape), a.ty.dtype, name=f"const{len(self.constants)}")
                self.env[a] = t
                self.constants[t] = value
            return self.env[a]
        if isinstance(a, relax.ShapeExpr):
            return list(a.values)
        if isinstance(a, relax.Var):
            if a not in self.env:
                raise KeyError(f"no TE value for {a.name}")
            return self.env[a]
        if isinstance(a, relax.Tuple):
            return [self.to_te(x) for x in a.fields]
        if isinstance(a, relax.PrimValue):
            return a.value
        return a


@contextlib.contextmanager
def _intercept_call_te(capture: _Capture):
    original = relax.BlockBuilder.call_te

    def call_te(_bb, func, *args, **kwargs):
        kwargs = {k: capture.to_te(v) for k, v in kwargs.items() if k not in _INTERNAL_KWARGS}
        return func(*[capture.to_te(a) for a in args], **kwargs)

    relax.BlockBuilder.call_te = call_te
    try:
        yield
    finally:
        relax.BlockBuilder.call_te = original


def _is_te_result(value) -> bool:
    if isinstance(value, te.Tensor):
        return True
    return isinstance(value, (list, tuple)) and len(value) > 0 and all(isinstance(v, te.Tensor) for v in value)


def _i64(dims) -> list:
    """Shapes as int64, as Relax's legalization makes them: TE index arithmetic stays one dtype."""
    return [tvm.tirx.IntImm("int64", int(d)) for d in dims]


def _static_shape(ty) -> list[int] | None:
    shape = getattr(ty, "shape", None)
    dims = getattr(shape, "values", None)
    if dims is None or not all(hasattr(d, "value") for d in dims):
        return None
    return [int(d.value) for d in dims]


def _placeholders_for(name: str, ty) -> list[te.Tensor]:
    fields = list(ty.fields) if isinstance(ty, relax.TupleType) else [ty]
    out = []
    for i, f in enumerate(fields):
        shape = _static_shape(f)
        if shape is None:
            raise LoweringError(f"binding {name!r}: result {i} is not a tensor of static shape ({f})")
        out.append(te.placeholder(_i64(shape), f.dtype, name=f"{name}_out{i}"))
    return out


def _all_tensors(ty) -> bool:
    if isinstance(ty, relax.TupleType):
        return all(_all_tensors(f) for f in ty.fields)
    return isinstance(ty, relax.TensorType)


def lower(mod: tvm.IRModule, func_name: str = "main", weight_values: list | None = None) -> TEProgram:
    """Lower ``mod[func_name]`` (inputs first, then weights, as the importer makes it) to TE.

    ``weight_values`` (numpy arrays in parameter order) lets transforms rewrite weights
    at compile time (the horizontal transform stacks them).
    """
    func = mod[func_name]
    num_input = int(func.attrs["num_input"]) if func.attrs and "num_input" in func.attrs else len(func.params)
    capture = _Capture()
    placeholders = []
    for p in func.params:
        shape = _static_shape(p.ty)
        if shape is None:
            raise LoweringError(f"parameter {p.name!r} has no static shape")
        t = te.placeholder(_i64(shape), p.ty.dtype, name=p.name)
        capture.env[p] = t
        placeholders.append(t)
    prog = TEProgram(placeholders[:num_input], placeholders[num_input:], [])
    if weight_values is not None:
        prog.weight_values = {w.op: v for w, v in zip(prog.weights, weight_values)}
    with _intercept_call_te(capture):
        for block in func.body.blocks:
            for b in block.bindings:
                _lower_binding(b, capture, prog, mod)
    if not _all_tensors(func.body.body.ty):
        # e.g. a static shape returned as a value (ONNX ``Shape`` of an input): not a stage
        raise LoweringError(f"{func_name} returns a value that is not a tensor ({func.body.body.ty})")
    result = capture.to_te(func.body.body)
    prog.outputs = result if isinstance(result, list) else [result]
    prog.constants = capture.constants
    return prog


def _lower_binding(b, capture: _Capture, prog: TEProgram, mod: tvm.IRModule) -> None:
    value = b.value
    if isinstance(value, relax.TupleGetItem):
        capture.env[b.var] = capture.to_te(value.tuple_value)[value.index]
        return
    if isinstance(value, (relax.Var, relax.Tuple, tvm.ir.GenericConst)):
        capture.env[b.var] = capture.to_te(value)
        return
    if isinstance(b.var.ty, relax.ShapeType) and b.var.ty.values is not None:
        capture.env[b.var] = list(b.var.ty.values)   # a static shape (shape_of of a static tensor)
        return
    reason = None
    if _call_tir_as_te(b, capture, prog, mod):
        return
    if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op):
        legalize = value.op.get_attr("FLegalize")
        if legalize is None:
            reason = f"{value.op.name} has no FLegalize"
        else:
            try:
                result = legalize(relax.BlockBuilder(), value)
            except Exception as err:  # noqa: BLE001 - any failure makes the op opaque, with the reason
                result, reason = None, f"{value.op.name}: legalization failed: {str(err).strip().splitlines()[-1][:160]}"
            if isinstance(result, tvm_ffi.Array):
                # a multi-output op (batch_norm, split) legalizes to an FFI array of tensors: its
                # fields are stages like any other, each read through the TupleGetItem that uses it
                result = list(result)
            if result is not None and _is_te_result(result):
                hand_written = _non_compute_op(result, prog)
                if hand_written is not None:
                    reason = f"{value.op.name}: legalizes to a hand-written ({hand_written}) kernel"
                else:
                    capture.env[b.var] = result
                    _record_ops(result, value.op.name, prog)
                    return
            reason = reason or f"{value.op.name}: legalizes to a non-TE call"
    else:
        reason = f"{type(value).__name__} binding"
    args, callees = {}, {}
    if isinstance(value, relax.Call):
        # the variables it reads, also inside tuples (call_tir passes its arguments as one)
        def note(v):
            if isinstance(v, relax.Var) and v in capture.env and isinstance(capture.env[v], te.Tensor):
                args[v] = capture.env[v]
            elif isinstance(v, tvm.ir.GlobalVar) and v in mod.get_global_vars():
                callees[v.name_hint] = mod[v]
        tvm_ffi.structural_walk(relax.Tuple(list(value.args)), [(tvm.ir.Var, note), (tvm.ir.GlobalVar, note)])
    outs = _placeholders_for(b.var.name, b.var.ty)
    capture.env[b.var] = outs if isinstance(b.var.ty, relax.TupleType) else outs[0]
    prog.opaque.append(OpaqueStage(b.var.name, value, args, outs, reason, callees))


def _call_tir_as_te(b, capture: _Capture, prog: TEProgram, mod: tvm.IRModule) -> bool:
    """A ``call_tir`` of a PrimFunc in ``mod`` that is one spatial loop nest becomes a TE stage
    (``from_primfunc``); True if it did."""
    value = b.value
    if not (isinstance(value, relax.Call) and getattr(value.op, "name", "") == "relax.call_tir"
            and isinstance(value.args[0], tvm.ir.GlobalVar) and value.args[0] in mod.get_global_vars()):
        return False
    callee = mod[value.args[0]]
    if not isinstance(callee, tvm.tirx.PrimFunc) or not isinstance(value.args[1], relax.Tuple):
        return False
    try:
        args = [capture.to_te(a) for a in value.args[1].fields]
    except KeyError:
        return False
    out = from_primfunc.as_te(callee, args)
    if out is None:
        return False
    capture.env[b.var] = out
    _record_ops(out, f"relax.call_tir {value.args[0].name_hint}", prog)
    return True


def _non_compute_op(result, prog: TEProgram) -> str | None:
    """The type of the first new op that is neither a compute nor a placeholder (extern, scan)."""
    stack = list(result) if isinstance(result, (list, tuple)) else [result]
    seen = set()
    while stack:
        t = stack.pop()
        if t.op in seen or t.op in prog.op_of:
            continue
        seen.add(t.op)
        if not isinstance(t.op, (te.ComputeOp, te.PlaceholderOp)):
            return type(t.op).__name__
        stack.extend(t.op.input_tensors)
    return None


def consumers_of(stages: list[te.Tensor]) -> dict:
    """{op: the ops among ``stages`` that read it} (each reader once per producer)."""
    users: dict = {}
    for t in stages:
        for inp in {x.op for x in t.op.input_tensors}:
            users.setdefault(inp, []).append(t.op)
    return users


def _record_ops(result, op_name: str, prog: TEProgram) -> None:
    """Name every TE op created for this relax op (a softmax makes four) after it."""
    stack = list(result) if isinstance(result, (list, tuple)) else [result]
    while stack:
        t = stack.pop()
        if t.op in prog.op_of and prog.op_of[t.op] != op_name:
            continue
        prog.op_of[t.op] = op_name
        stack.extend(i for i in t.op.input_tensors if i.op not in prog.op_of)


