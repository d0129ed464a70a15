"""Inference batch norm after a convolution, folded into the convolution's weights and bias.

CNN exports that keep ``BatchNormalization`` (torch's exporter with constant folding off, TF/Keras
exports, older model-zoo files) compute ``(conv(x, W) + b - mean) * gamma / sqrt(var + eps) +
beta`` per channel. With constant weights and statistics that is ``conv(x, W') + b'`` with
``W' = W * s`` per output channel and ``b' = (b - mean) * s + beta``, ``s = gamma / sqrt(var +
eps)``: the model then builds to the same kernels as the Conv→Relu an exporter that folds would
have written. A batch norm that does not follow a convolution with constant weights (or whose
convolution's result is read elsewhere too) stays, and lowers to TE as a per-channel scale and
shift.

Weights count as constant through what exporters put between them and the nodes: torch's
legacy exporter with constant folding off writes weights shared by value (the batch norms'
gammas of ones, betas of zeros) once and aliases them with ``Identity``; the dynamo exporter
unoptimized (``optimize=False``) gives a bias-free conv the bias ``Expand(CastLike(0, x), [C])``.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from .onnx_graph import constants


def fold_batch_norms(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    """A copy of ``model`` with every foldable Conv→BatchNormalization pair folded; also the
    names of the batch-norm nodes folded (the model itself if there is none)."""
    g = model.graph
    if not any(n.op_type == "BatchNormalization" for n in g.node):
        return model, []
    value = _values(g)
    inputs = {vi.name for vi in g.input} - {t.name for t in g.initializer}
    producer = {o: k for k, n in enumerate(g.node) for o in n.output}
    readers: dict[str, int] = {}
    for n in g.node:
        for i in n.input:
            readers[i] = readers.get(i, 0) + 1
    outputs = {o.name for o in g.output}
    plan = []
    for b_at, bn in enumerate(g.node):
        c_at = producer.get(bn.input[0]) if bn.op_type == "BatchNormalization" else None
        conv = g.node[c_at] if c_at is not None else None
        if conv is None or conv.op_type != "Conv" or len(bn.output) != 1 or readers.get(conv.output[0]) != 1 \
                or conv.output[0] in outputs:
            continue
        if any(a.name == "training_mode" and a.i for a in bn.attribute):
            continue
        params = list(conv.input[1:]) + list(bn.input[1:5])
        if len(bn.input) < 5 or any(p in inputs or value(p) is None for p in params if p):
            continue
        plan.append((c_at, b_at))
    if not plan:
        return model, []
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    folded, new_inits, dropped = [], [], set()
    for c_at, b_at in plan:
        conv, bn = g.node[c_at], g.node[b_at]
        w = value(conv.input[1]).astype(np.float64)
        b = value(conv.input[2]).astype(np.float64) if len(conv.input) > 2 and conv.input[2] else 0.0
        gamma, beta, mean, var = (value(n).astype(np.float64) for n in bn.input[1:5])
        eps = next((a.f for a in bn.attribute if a.name == "epsilon"), 1e-5)
        s = gamma / np.sqrt(var + eps)
        dtype = value(conv.input[1]).dtype
        stem = bn.output[0]
        new_inits += [numpy_helper.from_array((w * s.reshape(-1, *[1] * (w.ndim - 1))).astype(dtype), f"{stem}.bn_weight"),
                      numpy_helper.from_array(((b - mean) * s + beta).astype(dtype), f"{stem}.bn_bias")]
        dropped.update(p for p in list(conv.input[1:]) + list(bn.input[1:5]) if p)
        conv.input[:] = [conv.input[0], f"{stem}.bn_weight", f"{stem}.bn_bias"]
        conv.output[:] = [bn.output[0]]
        folded.append(bn.name or bn.output[0])
    remove = {b_at for _, b_at in plan}
    keep = [n for k, n in enumerate(g.node) if k not in remove]
    del g.node[:]
    g.node.extend(keep)
    # weights nothing reads any more go, so they are not passed to the compiled model; so do the
    # nodes that computed them (Constant, and the aliases and casts that _values evaluated)
    while True:
        used = {i for n in g.node for i in n.input} | {o.name for o in g.output}
        gone = {name for name in dropped if name not in used}
        dead = [n for n in g.node if n.op_type in _EVALUATED and n.output and set(n.output) <= gone]
        if not dead:
            break
        dropped.update(i for n in dead for i in n.input if value(i) is not None)
        nodes = [n for n in g.node if all(n is not d for d in dead)]
        del g.node[:]
        g.node.extend(nodes)
    inits = [t for t in g.initializer if t.name not in gone] + new_inits
    del g.initializer[:]
    g.initializer.extend(inits)
    listed = [vi for vi in g.input if vi.name not in gone]
    del g.input[:]
    g.input.extend(listed)
    return out, folded


_EVALUATED = ("Constant", "Identity", "CastLike", "Expand")


def _values(g: onnx.GraphProto):
    """A lookup of the value of a tensor that is a constant of the graph or what ``Identity``,
    ``CastLike`` or ``Expand`` compute from constants (``CastLike`` reads only its second
    input's type, where the graph records it); None for any other tensor."""
    values = constants(g)
    producer = {o: n for n in g.node if n.op_type in _EVALUATED[1:] for o in n.output}
    types = {vi.name: vi.type.tensor_type.elem_type for vi in list(g.input) + list(g.value_info) + list(g.output)}

    def value(name: str):
        if name in values or name not in producer:
            return values.get(name)
        n, result = producer[name], None
        ins = [value(i) for i in n.input]
        if ins[0] is not None and n.op_type == "Identity":
            result = ins[0]
        elif ins[0] is not None and n.op_type == "CastLike" and types.get(n.input[1]):
            result = ins[0].astype(onnx.helper.tensor_dtype_to_np_dtype(types[n.input[1]]))
        elif ins[0] is not None and n.op_type == "Expand" and ins[1] is not None:
            result = ins[0] * np.ones(ins[1].astype(np.int64), ins[0].dtype)
        values[name] = result
        return result

    return value
