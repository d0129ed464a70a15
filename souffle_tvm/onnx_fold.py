"""Fold an exported ONNX model's run-time shape arithmetic into constants before TVM imports it.

PyTorch's exporters write ``x.view(b, n, h, d)`` as Shape→Gather→Concat→Reshape, padding
amounts as Sub/Mod chains feeding Pad, zeros as ConstantOfShape(Shape(x)), and so on. TVM's
Relax importer fails on many of these ("Reshape requires the input new shape to be Shape",
"Dynamic pads are not supported yet", ...). Once every model input has a static shape, all of
that is compile-time arithmetic: this module fixes the input shapes in the graph, lets
onnxslim (shape inference + constant folding) evaluate it, inlines ``If`` branches and unrolls
``Loop``s whose condition / trip count became constants, and then checks that every input that
must be static (a new shape, pads, repeats, slice bounds, ...) is. What cannot be folded is
reported by node, naming the model input that keeps it dynamic.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .errors import DynamicShapeError, UnsupportedOperatorError

# Unrolling a Loop copies its body per iteration; beyond this the graph is too big to be useful.
MAX_UNROLL = 256

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


def set_input_shapes(model: onnx.ModelProto, shapes: dict[str, tuple[int, ...]]) -> None:
    """Write static dims into the graph inputs and drop the exporter's (symbolic) value_info."""
    for vi in model.graph.input:
        if vi.name not in shapes:
            continue
        dims = vi.type.tensor_type.shape.dim
        del dims[:]
        for d in shapes[vi.name]:
            dims.add().dim_value = int(d)
    # Intermediate shapes recorded by the exporter name symbols ("batch", "s0"), which would
    # stop shape inference from replacing them with numbers.
    del model.graph.value_info[:]


def _constants(graph: onnx.GraphProto) -> dict[str, np.ndarray]:
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


def _dynamic_sources(graph: onnx.GraphProto, tensor: str) -> list[str]:
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


def check_static(model: onnx.ModelProto) -> None:
    """Raise a DynamicShapeError for the first node whose shape-like input depends on a model input."""
    graph = model.graph
    consts = _constants(graph)
    for node in graph.node:
        for pos, role in SHAPE_INPUTS.get(node.op_type, {}).items():
            if pos >= len(node.input) or not node.input[pos] or node.input[pos] in consts:
                continue
            sources = _dynamic_sources(graph, node.input[pos])
            if not sources:  # computed from weights only: TVM's importer evaluates that itself
                continue
            where = f"it is computed at run time from model input(s) {', '.join(map(repr, sources))}"
            raise DynamicShapeError(
                f"node {node.name or node.output[0]!r} ({node.op_type}): its {role} input {node.input[pos]!r} "
                f"could not be folded to a constant; {where}. souffle-tvm compiles static graphs only: "
                "fix the input shapes (--input-shapes / shapes=) or export without data-dependent shapes")


def _rename(graph: onnx.GraphProto, prefix: str, mapping: dict[str, str]) -> tuple[list, list]:
    """Copies of ``graph``'s nodes and initializers with local names prefixed; ``mapping``
    (in/out) says what outer or earlier name each of the graph's inputs stands for."""
    local = {t.name for t in graph.initializer} | {o for n in graph.node for o in n.output if o}
    for name in local:
        mapping.setdefault(name, prefix + name)
    nodes = []
    for node in graph.node:
        new = onnx.NodeProto()
        new.CopyFrom(node)
        new.name = prefix + (node.name or node.output[0])
        new.input[:] = [mapping.get(i, i) if i else i for i in node.input]
        new.output[:] = [mapping[o] if o else o for o in node.output]
        nodes.append(new)
    inits = []
    for t in graph.initializer:
        new = onnx.TensorProto()
        new.CopyFrom(t)
        new.name = mapping[t.name]
        inits.append(new)
    return nodes, inits


def _scalar(value: np.ndarray, node: onnx.NodeProto, role: str):
    if value.size != 1:
        raise UnsupportedOperatorError(f"node {node.name!r} ({node.op_type}): {role} has {value.size} elements, not 1")
    return value.reshape(()).item()


def _inline_if(node, consts, prefix) -> tuple[list, list]:
    branch = "then_branch" if bool(_scalar(consts[node.input[0]], node, "the condition")) else "else_branch"
    graph = next(a.g for a in node.attribute if a.name == branch)
    mapping: dict[str, str] = {}
    nodes, inits = _rename(graph, prefix, mapping)
    # The branch's outputs become the If's outputs; an Identity keeps the two names apart.
    for out, target in zip(graph.output, node.output):
        nodes.append(helper.make_node("Identity", [mapping.get(out.name, out.name)], [target],
                                      name=f"{prefix}{target}/out"))
    return nodes, inits


def _unroll_loop(node, consts, prefix) -> tuple[list, list]:
    trip_name = node.input[0] if len(node.input) > 0 else ""
    cond_name = node.input[1] if len(node.input) > 1 else ""
    if not trip_name:
        raise UnsupportedOperatorError(f"node {node.name!r} (Loop): no trip count, so it cannot be unrolled; "
                                       "only loops with a constant trip count are supported")
    trips = int(_scalar(consts[trip_name], node, "the trip count"))
    if cond_name and cond_name not in consts:
        raise DynamicShapeError(f"node {node.name!r} (Loop): its condition {cond_name!r} is computed at run time")
    if cond_name and not bool(_scalar(consts[cond_name], node, "the condition")):
        trips = 0
    if trips > MAX_UNROLL:
        raise UnsupportedOperatorError(f"node {node.name!r} (Loop): {trips} iterations exceed the unroll limit "
                                       f"{MAX_UNROLL}")
    body = next(a.g for a in node.attribute if a.name == "body")
    carried = list(node.input[2:])
    n_carried = len(carried)
    n_scan = len(body.output) - 1 - n_carried
    if trips == 0 and n_scan:
        raise UnsupportedOperatorError(f"node {node.name!r} (Loop): zero iterations with scan outputs")
    body_consts = _constants(body)
    cond_out = body.output[0].name
    passes_cond = any(n.op_type == "Identity" and n.output[0] == cond_out and n.input[0] == body.input[1].name
                      for n in body.node) or cond_out == body.input[1].name
    if cond_out in body_consts:
        passes_cond = bool(_scalar(body_consts[cond_out], node, "the body's condition"))
    if not passes_cond:
        raise DynamicShapeError(f"node {node.name!r} (Loop): the body computes its continue condition "
                                f"{cond_out!r} at run time, so the loop cannot be unrolled")
    nodes, inits = [], []
    scans: list[list[str]] = [[] for _ in range(n_scan)]
    for i in range(trips):
        p = f"{prefix}iter{i}/"
        counter = f"{p}{body.input[0].name}"
        cond = f"{p}{body.input[1].name}"
        inits.append(numpy_helper.from_array(np.array(i, np.int64), counter))
        inits.append(numpy_helper.from_array(np.array(True), cond))
        mapping = {body.input[0].name: counter, body.input[1].name: cond}
        mapping.update({vi.name: v for vi, v in zip(body.input[2:], carried)})
        n, t = _rename(body, p, mapping)
        nodes += n
        inits += t
        outs = [mapping.get(o.name, o.name) for o in body.output]
        carried = outs[1:1 + n_carried]
        for k, name in enumerate(outs[1 + n_carried:]):
            axes = f"{p}scan{k}/axes"
            inits.append(numpy_helper.from_array(np.array([0], np.int64), axes))
            nodes.append(helper.make_node("Unsqueeze", [name, axes], [f"{p}scan{k}"], name=f"{p}scan{k}"))
            scans[k].append(f"{p}scan{k}")
    for src, target in zip(carried, node.output[:n_carried]):
        nodes.append(helper.make_node("Identity", [src], [target], name=f"{prefix}{target}/out"))
    for parts, target in zip(scans, node.output[n_carried:]):
        nodes.append(helper.make_node("Concat", parts, [target], axis=0, name=f"{prefix}{target}/out"))
    return nodes, inits


def inline_control_flow(model: onnx.ModelProto) -> bool:
    """Replace ``If`` nodes with a constant condition by the taken branch and unroll ``Loop``s with a
    constant trip count; returns whether anything changed. Run-time conditions are left alone."""
    graph = model.graph
    consts = _constants(graph)
    changed, new_nodes = False, []
    for k, node in enumerate(graph.node):
        prefix = f"{node.name or node.op_type}#{k}/"
        if node.op_type == "If" and node.input[0] in consts:
            nodes, inits = _inline_if(node, consts, prefix)
        elif node.op_type == "Loop" and (not node.input[0] or node.input[0] in consts):
            nodes, inits = _unroll_loop(node, consts, prefix)
        else:
            new_nodes.append(node)
            continue
        new_nodes += nodes
        graph.initializer.extend(inits)
        changed = True
    if changed:
        del graph.node[:]
        graph.node.extend(new_nodes)
    return changed


def check_control_flow(model: onnx.ModelProto) -> None:
    """Control flow left after folding has a run-time condition: name the node and its input."""
    for node in model.graph.node:
        if node.op_type == "Scan":
            raise UnsupportedOperatorError(
                f"node {node.name!r} (Scan): Scan is not supported (TVM's importer has no converter and it "
                "is not unrolled here); export the recurrence unrolled or as an LSTM/GRU node")
        if node.op_type in ("If", "Loop"):
            role = {"If": "condition", "Loop": "trip count"}[node.op_type]
            sources = _dynamic_sources(model.graph, node.input[0]) if node.input and node.input[0] else []
            why = f" (computed from model input(s) {', '.join(map(repr, sources))})" if sources else ""
            raise UnsupportedOperatorError(
                f"node {node.name!r} ({node.op_type}): its {role} does not fold to a constant{why}; "
                "souffle-tvm compiles static graphs only: control flow must be decided at compile time")


def _slim(model: onnx.ModelProto) -> onnx.ModelProto:
    import onnxslim

    # Graph fusion is left to TVM (onnxslim's patterns can emit non-standard ops); only folding,
    # shape inference, and dead-code / common-subexpression elimination are wanted here.
    logging.getLogger("onnxslim").setLevel(logging.ERROR)
    return onnxslim.slim(model, skip_optimizations=["graph_fusion"])


# Ops whose presence means the graph computes shapes or control decisions at run time.
_RUN_TIME_OPS = {"Shape", "Size", "If", "Loop", "Scan"}


def needs_folding(model: onnx.ModelProto) -> bool:
    """Whether the graph has run-time shape arithmetic or control flow for ``fold`` to resolve.

    Graphs without any (hand-built or already simplified ones, the zoo's) go to TVM untouched,
    so folding never rewrites a model that imports as it is.
    """
    return any(n.op_type in _RUN_TIME_OPS for n in model.graph.node)


def fold(model: onnx.ModelProto, shapes: dict[str, tuple[int, ...]]) -> onnx.ModelProto:
    """A copy of ``model`` with static input ``shapes``, its shape arithmetic folded to constants,
    constant control flow inlined, checked static (DynamicShapeError / UnsupportedOperatorError)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    set_input_shapes(out, shapes)
    try:
        out = _slim(out)
        # A condition or trip count is often itself shape arithmetic, constant only after folding;
        # an inlined branch or loop body may hold more, so fold again after each round.
        for _ in range(4):
            if not inline_control_flow(out):
                break
            out = _slim(out)
    except (DynamicShapeError, UnsupportedOperatorError):
        raise
    except Exception as err:  # noqa: BLE001 - onnxslim raises many types: one clean import error, cause chained
        raise UnsupportedOperatorError(f"folding shape computations failed: {type(err).__name__}: {err}") from err
    _keep_inputs(out, model, shapes)
    check_control_flow(out)
    check_static(out)
    return out


def _keep_inputs(folded: onnx.ModelProto, original: onnx.ModelProto, shapes: dict) -> None:
    """Restore the model's inputs, in their order, where onnxslim dropped unused ones: callers
    pass every declared input, so the imported function must still take them all."""
    have = {vi.name: vi for vi in folded.graph.input}
    if all(vi.name in have for vi in original.graph.input if vi.name in shapes):
        return
    inputs = []
    for vi in original.graph.input:
        if vi.name in have:
            inputs.append(have.pop(vi.name))
        elif vi.name in shapes:
            fixed = onnx.ValueInfoProto()
            fixed.CopyFrom(vi)
            dims = fixed.type.tensor_type.shape.dim
            del dims[:]
            for d in shapes[vi.name]:
                dims.add().dim_value = int(d)
            inputs.append(fixed)
    inputs += have.values()
    del folded.graph.input[:]
    folded.graph.input.extend(inputs)
