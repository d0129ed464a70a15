"""Operator forms TVM's ONNX importer gets wrong: corrected converters, or a clear refusal.

Found by ONNX's own conformance suite (python/onnx_conformance.py, results/onnx-conformance-*.md).

* :data:`CONVERTERS` replace TVM 0.27's converters where its result differs from ONNX's
  semantics and the fix is a few Relax ops: ``ReduceMax``/``ReduceMin`` of a row that is all
  -inf/+inf (TVM's reduction starts from the largest finite value), ``Mod`` (``fmod=0``) by an
  infinite divisor, ``Softplus``/``Mish`` of large negative inputs (``log(1 + tiny)`` rounds),
  ``IsInf``'s ``detect_negative``/``detect_positive``, ``BitShift`` by a negative amount or by the
  width or more, ``PRelu`` before opset 7 (a 1-D slope is per channel, axis 1),
  ``SequenceInsert`` at a negative position.
* :func:`check_forms` refuses, with an ``UnsupportedOperatorError`` naming the node and why,
  the forms that would otherwise build and compute something else (or crash in TVM).
"""

from __future__ import annotations

import functools

import numpy as np
import onnx
import tvm
from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend as _onnx

from ..errors import UnsupportedOperatorError

# ---- corrected converters -------------------------------------------------------------------


def _dtype(expr) -> str:
    return str(expr.ty.dtype)


def _is_float(expr) -> bool:
    return _dtype(expr).startswith(("float", "bfloat"))


def _after(base: type, fix, name: str) -> type:
    """A converter class: TVM's ``base`` converter for the model's opset, then ``fix(result, inputs, attr)``."""
    def get_converter(cls, opset):
        convert = base.get_converter(opset)

        def run(bb, inputs, attr, params):
            return fix(convert(bb, inputs, attr, params), inputs, attr)
        return run
    return type(name, (base,), {"get_converter": classmethod(get_converter)})


def _reduce_extreme(sign: float):
    """ReduceMax (sign -inf) / ReduceMin (+inf): a row whose values are all ``sign`` reduces to it."""
    def fix(out, inputs, attr):
        data = inputs[0]
        if not _is_float(data) or not isinstance(out, relax.Expr):
            return out
        dt = _dtype(data)
        extreme = relax.const(sign, dt)
        # max(x) over the same axes, of (x != extreme) as 0/1: 0 exactly where every value is extreme
        mask = relax.op.astype(relax.op.not_equal(data, extreme), dt)
        reduced = _same_reduction(mask, inputs, attr)
        if reduced is None:
            return out
        return relax.op.where(relax.op.equal(reduced, relax.const(0, dt)), extreme, out)
    return fix


def _same_reduction(mask, inputs, attr):
    """``max`` of ``mask`` over the axes the ONNX node reduces (None if they are not constant)."""
    keepdims = bool(attr.get("keepdims", 1))
    axes = attr.get("axes")
    if len(inputs) > 1 and inputs[1] is not None:
        const = inputs[1]
        if not isinstance(const, tvm.ir.GenericConst):
            return None
        axes = [int(a) for a in np.asarray(const.value.numpy()).reshape(-1)]
        if not axes and attr.get("noop_with_empty_axes", 0):
            return mask
    axes = list(axes) if axes is not None and len(axes) else None
    return relax.op.max(mask, axes, keepdims)


def _mod_fix(out, inputs, attr):
    """Python's ``x % y`` for an infinite ``y`` and finite ``x``: ``x`` when they agree in sign (or
    ``x`` is 0), else ``y``. TVM's ``x - floor(x / y) * y`` gives NaN there."""
    x, y = inputs[0], inputs[1]
    if attr.get("fmod", 0) != 0 or not _is_float(x) or not _is_float(y):
        return out
    zero = relax.const(0, _dtype(x))
    same = relax.op.logical_or(relax.op.equal(x, zero),
                               relax.op.logical_not(relax.op.logical_xor(relax.op.less(x, zero),
                                                                                    relax.op.less(y, zero))))
    # (isfinite fails LLVM's verifier in TVM 0.27: not inf and not NaN instead)
    finite = relax.op.logical_not(relax.op.logical_or(relax.op.isinf(x), relax.op.isnan(x)))
    inf_case = relax.op.logical_and(relax.op.isinf(y), finite)
    return relax.op.where(inf_case, relax.op.where(same, x, y), out)


def _log1p_small(e, dt: str):
    """log(1 + e) for 0 <= e <= 1, accurate where ``1 + e`` rounds: e - e^2/2 + e^3/3 below 1e-3."""
    one = relax.const(1, dt)
    series = e * (one - e * (relax.const(0.5, dt) - e * relax.const(1.0 / 3.0, dt)))
    return relax.op.where(relax.op.less(e, relax.const(1e-3, dt)), series, relax.op.log(one + e))


def _softplus(x):
    dt = _dtype(x)
    return relax.op.maximum(x, relax.const(0, dt)) + _log1p_small(relax.op.exp(relax.op.negative(relax.op.abs(x))), dt)


class Softplus(_onnx.OnnxOpConverter):
    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        return _softplus(inputs[0])


class Mish(_onnx.OnnxOpConverter):
    @classmethod
    def _impl_v18(cls, bb, inputs, attr, params):
        return inputs[0] * relax.op.tanh(_softplus(inputs[0]))


class IsInf(_onnx.OnnxOpConverter):
    @classmethod
    def _impl_v10(cls, bb, inputs, attr, params):
        x = inputs[0]
        out = relax.op.isinf(x)
        zero = relax.const(0, _dtype(x))
        if not attr.get("detect_negative", 1):
            out = relax.op.logical_and(out, relax.op.greater(x, zero))
        if not attr.get("detect_positive", 1):
            out = relax.op.logical_and(out, relax.op.less(x, zero))
        return out


class BitShift(_onnx.OnnxOpConverter):
    """A shift by a negative amount or by the width or more gives 0 (-1 for a right shift of a
    negative signed value), as ONNX's reference does; C's shift (TVM's) is undefined there."""

    @classmethod
    def _impl_v11(cls, bb, inputs, attr, params):
        x, s = inputs[0], inputs[1]
        direction = attr.get("direction", b"LEFT")
        direction = direction.decode() if isinstance(direction, bytes) else direction
        if direction not in ("LEFT", "RIGHT"):
            raise ValueError(f"Unsupported Shift Direction: {direction}")
        dt = _dtype(x)
        bits = int(np.dtype(dt).itemsize * 8)
        zero = relax.const(0, dt)
        shifted = relax.op.left_shift(x, s) if direction == "LEFT" else relax.op.right_shift(x, s)
        out_of_range = relax.op.logical_or(relax.op.less(s, zero), relax.op.greater_equal(s, relax.const(bits, dt)))
        fill = zero * x
        if direction != "LEFT" and not dt.startswith("uint"):
            fill = relax.op.where(relax.op.less(x, zero), relax.const(-1, dt) + fill, fill)
        return relax.op.where(out_of_range, fill, shifted)


class PRelu(_onnx.PRelu):
    """Before opset 7 a 1-D slope whose length is the channel count applies per channel (axis 1);
    from opset 7 ONNX broadcasts it numpy-style (the last axis), which is TVM's reading for all."""

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        x, slope = inputs
        xs, ss = [int(d) for d in x.ty.shape], [int(d) for d in slope.ty.shape]
        if len(ss) == 1 and len(xs) >= 2 and ss[0] == xs[1] and ss[0] != 1:
            return relax.op.nn.prelu(x, slope, 1)
        return _onnx.PRelu._impl_v1(bb, inputs, attr, params)

    @classmethod
    def _impl_v7(cls, bb, inputs, attr, params):
        return _onnx.PRelu._impl_v1(bb, inputs, attr, params)


class SequenceInsert(_onnx.SequenceInsert):
    """A negative position counts from the back: -1 inserts before the last tensor (TVM appends)."""

    @classmethod
    def _impl_v11(cls, bb, inputs, attr, params):
        if len(inputs) == 3 and isinstance(inputs[2], tvm.ir.GenericConst):
            position = int(inputs[2].value.numpy())
            if position < 0:
                n = len(inputs[0])
                at = _onnx.onnx_input([inputs[0], inputs[1], relax.const(n + position, "int64")])
                return _onnx.SequenceInsert._impl_v11(bb, at, attr, params)
        return _onnx.SequenceInsert._impl_v11(bb, inputs, attr, params)


def _is_f16(x) -> bool:
    ty = getattr(x, "ty", None) if isinstance(x, relax.Expr) else None
    return isinstance(ty, relax.TensorType) and str(ty.dtype) == "float16"


def _in_float32(base: type, name: str) -> type:
    """``base``'s converter on float16 inputs cast to float32, its result cast back: the
    contraction accumulates in float32 (products of float16 values are exact in float32)."""
    def get_converter(cls, opset):
        convert = base.get_converter(opset)

        def run(bb, inputs, attr, params):
            if not any(_is_f16(x) for x in inputs):
                return convert(bb, inputs, attr, params)
            up = _onnx.onnx_input(bb.normalize(relax.op.astype(x, "float32")) if _is_f16(x) else x for x in inputs)
            return relax.op.astype(bb.normalize(convert(bb, up, attr, params)), "float16")
        return run
    return type(name, (base,), {"get_converter": classmethod(get_converter)})


class _Softmax16(_in_float32(_onnx.Softmax, "Softmax")):
    """Softmax (opset 13+) of float16 as ONNX's reference computes it: max, exp and the quotient
    in float16, the sum accumulated in float32 and rounded to float16."""

    @classmethod
    def get_converter(cls, opset):
        wide = super().get_converter(opset)

        def run(bb, inputs, attr, params):
            x = inputs[0]
            if opset < 13 or not _is_f16(x):
                return wide(bb, inputs, attr, params)
            axis = int(attr.get("axis", -1))
            e = relax.op.exp(x - relax.op.max(x, [axis], keepdims=True))
            total = relax.op.astype(relax.op.sum(relax.op.astype(e, "float32"), [axis], keepdims=True), "float16")
            return e / total
        return run


#: with ``import_onnx(..., fp16_accumulation="float32")``: float16 contractions and reductions
#: accumulate in float32, as ONNX's reference (numpy) does; the default keeps float16
FLOAT32_ACCUMULATION = {op: _in_float32(getattr(_onnx, op), op) for op in (
    "MatMul", "Gemm", "Conv", "ConvTranspose", "Softmax", "LogSoftmax", "ReduceSum", "ReduceMean", "ReduceSumSquare",
    "ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "LayerNormalization")}
FLOAT32_ACCUMULATION["Softmax"] = _Softmax16

CONVERTERS = {
    "ReduceMax": _after(_onnx.ReduceMax, _reduce_extreme(-np.inf), "ReduceMax"),
    "ReduceMin": _after(_onnx.ReduceMin, _reduce_extreme(np.inf), "ReduceMin"),
    # float16 fmod in float32 (exact: fmod's result is representable in its inputs' type): TVM
    # 0.27's CUDA codegen has no float16 fmod ("Non single or double precision floating point in Mod")
    "Mod": _in_float32(_after(_onnx.Mod, _mod_fix, "Mod"), "Mod"),
    "Softplus": Softplus, "Mish": Mish, "IsInf": IsInf, "BitShift": BitShift, "PRelu": PRelu,
    "SequenceInsert": SequenceInsert,
}

# ---- forms refused --------------------------------------------------------------------------

#: element types a Cast may produce (TVM 0.27 has no float8/float4/int4/int2 arithmetic on llvm)
CAST_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE, onnx.TensorProto.BFLOAT16,
              onnx.TensorProto.INT8, onnx.TensorProto.UINT8, onnx.TensorProto.INT16, onnx.TensorProto.UINT16,
              onnx.TensorProto.INT32, onnx.TensorProto.UINT32, onnx.TensorProto.INT64, onnx.TensorProto.UINT64,
              onnx.TensorProto.BOOL}


def _attrs(node) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _elem_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every value the graph declares or shape inference finds (best effort)."""
    try:
        graph = onnx.shape_inference.infer_shapes(model).graph
    except Exception:  # noqa: BLE001 - inference is a help here, never a requirement
        graph = model.graph
    types = {t.name: t.data_type for t in graph.initializer}
    for vi in list(graph.input) + list(graph.value_info) + list(graph.output):
        if vi.type.HasField("tensor_type"):
            types[vi.name] = vi.type.tensor_type.elem_type
    return types


class _Facts:
    """What a check may ask of the model, computed only when asked (models carry large weights)."""

    def __init__(self, model: onnx.ModelProto):
        self.model = model

    @functools.cached_property
    def types(self) -> dict[str, int]:
        return _elem_types(self.model)

    @functools.cached_property
    def used(self) -> set[str]:
        """Values a node reads or the graph returns."""
        return {i for n in self.model.graph.node for i in n.input} | {o.name for o in self.model.graph.output}

    def constant(self, name: str) -> np.ndarray | None:
        for t in self.model.graph.initializer:
            if t.name == name:
                return onnx.numpy_helper.to_array(t)
        for node in self.model.graph.node:
            if node.op_type == "Constant" and node.output[0] == name:
                value = [a.t for a in node.attribute if a.name == "value"]
                return onnx.numpy_helper.to_array(value[0]) if value else None
        return None


def _why_not(node, attrs: dict, facts: _Facts) -> str | None:
    op, outs = node.op_type, [o for o in node.output]
    if op == "BatchNormalization" and attrs.get("training_mode", 0):
        return "training mode (training_mode=1): souffle-tvm compiles inference"
    if op == "Dropout":
        if len(outs) > 1 and outs[1] and outs[1] in facts.used:
            return "its mask output is used (inference returns the input unchanged; the mask is not computed)"
        if len(node.input) > 2 and node.input[2]:
            mode = facts.constant(node.input[2])
            if mode is None or bool(np.asarray(mode).reshape(-1)[0]):
                return "training mode (a training_mode input that is not a constant false)"
    if op == "LayerNormalization" and any(outs[1:]):
        return "its Mean/InvStdDev outputs (only the normalized output is computed)"
    if op == "Cast" and attrs.get("to") not in CAST_TYPES:
        return f"a cast to {onnx.TensorProto.DataType.Name(attrs.get('to', 0))} (no such type in TVM's arithmetic)"
    if op == "CastLike" and len(node.input) > 1:
        like = facts.types.get(node.input[1], onnx.TensorProto.FLOAT)
        if like not in CAST_TYPES:
            return f"a cast to {onnx.TensorProto.DataType.Name(like)} (no such type in TVM's arithmetic)"
    if op == "ConvTranspose" and "output_shape" in attrs:
        return "the output_shape attribute (give pads/output_padding instead)"
    if op == "Pow" and facts.types.get(node.input[0]) in (onnx.TensorProto.INT32, onnx.TensorProto.INT64, onnx.TensorProto.INT8,
                                                    onnx.TensorProto.UINT8, onnx.TensorProto.INT16):
        return "an integer base (TVM's power is defined for floating point only)"
    if op == "RoiAlign" and _text(attrs.get("mode", "avg")) == "max":
        return "mode='max' (TVM's max pooling of the samples differs from ONNX's)"
    if op == "SpaceToDepth" and _text(attrs.get("mode", "DCR")) != "DCR":
        return f"mode={_text(attrs['mode'])!r} (TVM implements DCR only)"
    if op == "RMSNormalization" and int(attrs.get("axis", -1)) in (0,):
        return "axis=0 (normalizing over every axis crashes TVM's converter)"
    if op == "NonMaxSuppression":
        return "its output's shape depends on the input values (data-dependent shapes are not compiled)"
    return None


def _negative_rms_axis(node, attrs: dict, ranks: dict[str, int]) -> bool:
    if node.op_type != "RMSNormalization":
        return False
    rank = ranks.get(node.input[0])
    return rank is not None and int(attrs.get("axis", -1)) == -rank


def check_forms(model: onnx.ModelProto) -> None:
    """Refuse, naming the node, the operator forms TVM 0.27 builds into something else."""
    facts = _Facts(model)
    ranks = {vi.name: len(vi.type.tensor_type.shape.dim) for vi in model.graph.input if vi.type.HasField("tensor_type")}
    for node in model.graph.node:
        if node.domain not in ("", "ai.onnx"):
            continue
        attrs = _attrs(node)
        why = _why_not(node, attrs, facts)
        if why is None and _negative_rms_axis(node, attrs, ranks):
            why = "an axis that is every axis (normalizing over every axis crashes TVM's converter)"
        if why is not None:
            raise UnsupportedOperatorError(f"unsupported form of {node.op_type} (node {node.name or node.output[0]!r}): {why}")
