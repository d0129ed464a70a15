"""What the folding and the control-flow passes both read off an ONNX graph: which node inputs
must be constants, the graph's constant values, and the model inputs a tensor depends on; and
the structure every import checks first (one producer per tensor, no cycle)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from ..errors import ModelLoadError

# Inputs (by position) that TVM's importer needs as constants, with what they mean.
SHAPE_INPUTS: dict[str, dict[int, str]] = {
    "Reshape": {1: "shape"}, "Expand": {1: "shape"}, "ConstantOfShape": {0: "shape"},
    "Pad": {1: "pads", 3: "axes"}, "Tile": {1: "repeats"}, "Range": {0: "start", 1: "limit", 2: "delta"},
    "Slice": {1: "starts", 2: "ends", 3: "axes", 4: "steps"}, "Resize": {2: "scales", 3: "sizes"},
    "Upsample": {1: "scales"}, "TopK": {1: "k"}, "OneHot": {1: "depth"}, "Squeeze": {1: "axes"},
    "Unsqueeze": {1: "axes"}, "Split": {1: "split"}, "ReduceSum": {1: "axes"}, "ReduceMean": {1: "axes"},
    "ReduceMax": {1: "axes"}, "ReduceMin": {1: "axes"}, "ReduceProd": {1: "axes"},
    "ReduceL2": {1: "axes"}, "CumSum": {1: "axis"}, "If": {0: "condition"}, "Loop": {0: "trip count"},
}


def constants(graph: onnx.GraphProto) -> dict[str, np.ndarray]:
    values = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant" and node.output:
            attr = node.attribute[0]
            if attr.name == "value":
                values[node.output[0]] = numpy_helper.to_array(attr.t)
            elif attr.name in ("value_int", "value_float"):
                values[node.output[0]] = np.array(attr.i if attr.name == "value_int" else attr.f)
            elif attr.name in ("value_ints", "value_floats"):
                values[node.output[0]] = np.array(list(attr.ints or attr.floats))
    return values


def dynamic_sources(graph: onnx.GraphProto, tensor: str) -> list[str]:
    """The model inputs from which ``tensor`` is computed (the reason it is not a constant)."""
    producers = {o: n for n in graph.node for o in n.output}
    inputs = {vi.name for vi in graph.input}
    seen, stack, found = set(), [tensor], []
    while stack:
        name = stack.pop()
        if name in seen or not name:
            continue
        seen.add(name)
        if name in inputs:
            found.append(name)
        elif name in producers:
            stack.extend(producers[name].input)
    return sorted(found)


# ONNX element types a model input may have, as numpy dtype names
NP_DTYPES = {
    onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.FLOAT16: "float16",
    onnx.TensorProto.DOUBLE: "float64", onnx.TensorProto.INT64: "int64",
    onnx.TensorProto.INT32: "int32", onnx.TensorProto.BOOL: "bool",
    onnx.TensorProto.INT8: "int8", onnx.TensorProto.UINT8: "uint8",
}


def _node_label(node: onnx.NodeProto, index: int) -> str:
    return f"{node.name!r} ({node.op_type})" if node.name else f"#{index} ({node.op_type}, unnamed)"


def check_structure(name: str, graph: onnx.GraphProto) -> None:
    """Refuse, naming the nodes, a graph in which two nodes write one tensor or whose nodes
    form a cycle (the checker reports both only as an unsorted or non-SSA graph)."""
    producer: dict[str, int] = {}
    for i, node in enumerate(graph.node):
        for out in node.output:
            if not out:
                continue
            if out in producer:
                first = producer[out]
                raise ModelLoadError(f"{name}: tensor {out!r} is written by two nodes, "
                                     f"{_node_label(graph.node[first], first)} and {_node_label(node, i)}; "
                                     "each tensor must have one producer")
            producer[out] = i
    preds = [{producer[t] for t in node.input if t in producer} for node in graph.node]
    # Kahn's order: what never becomes ready lies on a cycle or after one
    users: dict[int, list[int]] = {}
    for i, ps in enumerate(preds):
        for p in ps:
            users.setdefault(p, []).append(i)
    waiting = [len(ps) for ps in preds]
    ready = [i for i, n in enumerate(waiting) if n == 0]
    while ready:
        for u in users.get(ready.pop(), []):
            waiting[u] -= 1
            if waiting[u] == 0:
                ready.append(u)
    stuck = {i for i, n in enumerate(waiting) if n}
    if not stuck:
        return
    # every stuck node has a stuck predecessor: walking back from one must close a cycle
    walk, seen = [min(stuck)], {}
    while walk[-1] not in seen:
        seen[walk[-1]] = len(walk) - 1
        walk.append(min(p for p in preds[walk[-1]] if p in stuck))
    cycle = walk[seen[walk[-1]]:][::-1]
    path = " -> ".join(_node_label(graph.node[i], i) for i in cycle)
    raise ModelLoadError(f"{name}: the graph has a cycle: {path}; an ONNX graph must be acyclic "
                         "(repetition is written with Loop or Scan)")
