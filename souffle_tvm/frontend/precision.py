"""Mixed precision for any ONNX model (``--dtype float16`` / ``--dtype bfloat16``), as users of
TensorRT's ``--fp16``/``--bf16`` expect: the model's float32 compute and weights in the low type,
its inputs and outputs still float32 (one Cast each at the edges), and the numerically
sensitive operators (softmax, normalisations, reductions, exp, log, pow, sqrt) kept in float32
between Casts, so their sums and exponents do not lose range or precision.

The conversion is on the ONNX graph, before TVM imports it, so the weights are stored in the
low type once, at compile time, instead of being cast on every inference; float inputs an
operator requires to be float32 (Resize's scales and region of interest) are cast back.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..errors import OptionsError

LOW = {"float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}
DTYPES = ("float32", *LOW)

#: operators computed in float32 between Casts (their float inputs up, their float outputs down)
KEPT_FLOAT32 = frozenset({
    "Softmax", "LogSoftmax", "LayerNormalization", "InstanceNormalization", "GroupNormalization",
    "RMSNormalization", "ReduceMean", "ReduceSum", "ReduceSumSquare", "ReduceL2", "ReduceL1", "ReduceLogSum",
    "ReduceLogSumExp", "Exp", "Log", "Pow", "Sqrt", "Reciprocal", "Erf", "Softplus", "CumSum"})

#: (operator, input position) that the ONNX spec types float32 whatever the data's type
FLOAT32_INPUTS = {("Resize", 1), ("Resize", 2), ("Upsample", 1)}

#: operators with a subgraph: their bodies would need the same conversion, which is not done
SUBGRAPH_OPS = frozenset({"If", "Loop", "Scan"})


def _low_array(array: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        import ml_dtypes

        return array.astype(ml_dtypes.bfloat16)
    return array.astype(np.float16)


def _float_tensors(model: onnx.ModelProto) -> set[str]:
    """Names of every float32 tensor of the graph (inputs, initializers, node outputs)."""
    inferred = onnx.shape_inference.infer_shapes(model)
    g = inferred.graph
    out = {t.name for t in g.initializer if t.data_type == TensorProto.FLOAT}
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        if vi.type.tensor_type.elem_type == TensorProto.FLOAT:
            out.add(vi.name)
    for node in g.node:
        if node.op_type == "Constant":
            for a in node.attribute:
                if a.name == "value" and a.t.data_type == TensorProto.FLOAT:
                    out.update(node.output)
                if a.name in ("value_float", "value_floats"):
                    out.update(node.output)
    return out


def _elem_types(model: onnx.ModelProto) -> set[int]:
    g = model.graph
    return {t.data_type for t in g.initializer} | {vi.type.tensor_type.elem_type for vi in g.input}


def needs_conversion(model: onnx.ModelProto, dtype: str) -> bool:
    """Whether ``model`` must be converted to compute in ``dtype``: not float32, and the model
    not already in it (a model exported in float16 is compiled as it is for ``--dtype float16``)."""
    if dtype == "float32":
        return False
    types = _elem_types(model)
    return not (LOW.get(dtype) in types and TensorProto.FLOAT not in {t.data_type for t in model.graph.initializer})


def compute_dtype(model: onnx.ModelProto) -> str:
    """The floating type most of ``model``'s weights are stored in (float32 without any)."""
    counts = {}
    for t in model.graph.initializer:
        if t.data_type in (TensorProto.FLOAT, *LOW.values()):
            counts[t.data_type] = counts.get(t.data_type, 0) + 1
    best = max(counts, key=counts.get, default=TensorProto.FLOAT)
    return {TensorProto.FLOAT: "float32", TensorProto.FLOAT16: "float16", TensorProto.BFLOAT16: "bfloat16"}[best]


def convert(model: onnx.ModelProto, dtype: str) -> onnx.ModelProto:
    """``model`` computing in ``dtype`` (``DTYPES``); float32 returns it unchanged. A dtype that
    cannot apply (an unknown one, a model with no float32 compute, subgraphs) is refused."""
    if dtype == "float32":
        return model
    if dtype not in LOW:
        raise OptionsError(f"--dtype {dtype!r}: one of {', '.join(DTYPES)}")
    g0 = model.graph
    sub = sorted({n.op_type for n in g0.node if n.op_type in SUBGRAPH_OPS})
    if sub:
        raise OptionsError(f"--dtype {dtype}: the model has {', '.join(sub)} subgraphs, which the conversion does "
                           "not reach; export it in the precision wanted, or compile in float32")
    floats = _float_tensors(model)
    if not floats:
        raise OptionsError(f"--dtype {dtype}: the model computes nothing in float32 to convert")
    low = LOW[dtype]
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    for t in g.initializer:
        if t.data_type == TensorProto.FLOAT:
            t.CopyFrom(numpy_helper.from_array(_low_array(numpy_helper.to_array(t), dtype), t.name))
    nodes: list[onnx.NodeProto] = []
    fresh = iter(range(1 << 30))

    def cast(name: str, to: int) -> str:
        out = f"{name}__{'f32' if to == TensorProto.FLOAT else dtype}{next(fresh)}"
        nodes.append(helper.make_node("Cast", [name], [out], to=to))
        return out

    renamed: dict[str, str] = {}
    for vi in g.input:               # float32 inputs stay float32 outside, the low type inside
        if vi.type.tensor_type.elem_type == TensorProto.FLOAT and vi.name not in {t.name for t in g.initializer}:
            renamed[vi.name] = cast(vi.name, low)
    floats |= set(renamed.values())      # an input's low twin is a float tensor of the graph too
    outputs = {vi.name for vi in g.output if vi.type.tensor_type.elem_type == TensorProto.FLOAT}
    for node in g.node:
        node = _copy(node)
        node.input[:] = [renamed.get(i, i) for i in node.input]
        if node.op_type == "ConstantOfShape" and _attr(node, "value") is None:     # float32 zeros by default
            node.attribute.append(helper.make_attribute("value", numpy_helper.from_array(
                _low_array(np.zeros(1, np.float32), dtype))))
        if node.op_type == "Cast" and _attr(node, "to") == TensorProto.FLOAT:
            del node.attribute[:]
            node.attribute.append(helper.make_attribute("to", low))
        elif node.op_type in ("Constant", "ConstantOfShape"):
            _lower_constant(node, dtype)
        for j, name in enumerate(node.input):
            if (node.op_type, j) in FLOAT32_INPUTS and name in floats:
                node.input[j] = cast(name, TensorProto.FLOAT)
        if node.op_type in KEPT_FLOAT32:
            node.input[:] = [cast(i, TensorProto.FLOAT) if i in floats else i for i in node.input]
            wide = list(node.output)
            node.output[:] = [f"{o}__wide" if o in floats else o for o in wide]
            nodes.append(node)
            for o, w in zip(wide, node.output):
                if w != o:
                    nodes.append(helper.make_node("Cast", [w], [o], to=low))
            continue
        nodes.append(node)
    twin = {o: f"{o}__{dtype}" for o in outputs}
    for node in nodes:               # outputs leave in float32: inside, everyone uses a low twin
        node.output[:] = [twin.get(o, o) for o in node.output]
        node.input[:] = [twin.get(i, i) for i in node.input]
    for name in outputs:
        nodes.append(helper.make_node("Cast", [f"{name}__{dtype}"], [name], to=TensorProto.FLOAT))
    g.ClearField("node")
    g.node.extend(nodes)
    g.ClearField("value_info")
    onnx.checker.check_model(m)
    return m


def _copy(node: onnx.NodeProto) -> onnx.NodeProto:
    n = onnx.NodeProto()
    n.CopyFrom(node)
    return n


def _attr(node: onnx.NodeProto, name: str):
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), None)


def _lower_constant(node: onnx.NodeProto, dtype: str) -> None:
    """A float32 Constant or ConstantOfShape value in the low type."""
    for a in node.attribute:
        if a.name == "value" and a.t.data_type == TensorProto.FLOAT:
            a.t.CopyFrom(numpy_helper.from_array(_low_array(numpy_helper.to_array(a.t), dtype), a.t.name))
        elif a.name in ("value_float", "value_floats"):
            value = np.asarray(helper.get_attribute_value(a), np.float32)
            a.CopyFrom(helper.make_attribute("value", numpy_helper.from_array(_low_array(value, dtype))))
