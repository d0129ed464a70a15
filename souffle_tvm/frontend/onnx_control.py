"""Constant control flow made straight-line before TVM's import (``onnx_fold.fold`` calls it).

An ``If`` whose condition folded to a constant becomes its taken branch; a ``Loop`` whose trip
count (and condition) folded, and a ``Scan`` whose sequence length is static, are unrolled: one
renamed copy of the body per iteration, the state threaded from copy to copy, per-iteration
outputs stacked with Unsqueeze + Concat. Body nodes keep reading outer-scope values by name.
What is left has a run-time condition, trip count or length and is named by ``check_control_flow``.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..errors import DynamicShapeError, UnsupportedOperatorError
from .onnx_graph import SHAPE_INPUTS, constants, dynamic_sources

# Unrolling copies the body per iteration; beyond this the graph is too big to be useful.
MAX_UNROLL = 256


def _subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    return [g for a in node.attribute for g in ([a.g] if a.HasField("g") else list(a.graphs))]


def _rename_refs(graph: onnx.GraphProto, mapping: dict[str, str]) -> None:
    """Point a nested subgraph's reads of renamed outer values at their new names (in place)."""
    own = ({vi.name for vi in graph.input} | {t.name for t in graph.initializer}
           | {o for n in graph.node for o in n.output})
    outer = {k: v for k, v in mapping.items() if k not in own}
    for node in graph.node:
        node.input[:] = [outer.get(i, i) for i in node.input]
        for g in _subgraphs(node):
            _rename_refs(g, outer)
    for vi in graph.output:
        vi.name = outer.get(vi.name, vi.name)


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
        for g in _subgraphs(new):
            _rename_refs(g, mapping)
        nodes.append(new)
    inits = []
    for t in graph.initializer:
        new = onnx.TensorProto()
        new.CopyFrom(t)
        new.name = mapping[t.name]
        inits.append(new)
    return nodes, inits


def _instance(body: onnx.GraphProto, prefix: str, mapping: dict[str, str]) -> tuple[list, list, list[str]]:
    """One renamed copy of ``body`` with its inputs bound by ``mapping``: nodes, initializers,
    and the names its outputs have in the copy."""
    nodes, inits = _rename(body, prefix, mapping)
    return nodes, inits, [mapping.get(o.name, o.name) for o in body.output]


def _identity(src: str, target: str, prefix: str) -> onnx.NodeProto:
    return helper.make_node("Identity", [src], [target], name=f"{prefix}{target}/out")


def _with_axes(op: str, data: str, axes: list[int], output: str, opset: int) -> tuple[list, list]:
    """A Squeeze / Unsqueeze of ``data``: ``axes`` an attribute before opset 13, an input from it on."""
    if opset < 13:
        return [helper.make_node(op, [data], [output], axes=axes, name=output)], []
    init = numpy_helper.from_array(np.array(axes, np.int64), f"{output}/axes")
    return [helper.make_node(op, [data, init.name], [output], name=output)], [init]


def _stack(parts: list[str], target: str, axis: int, prefix: str, opset: int) -> tuple[list, list]:
    """``target`` = the ``parts`` stacked along a new ``axis`` (Unsqueeze each, Concat)."""
    nodes, inits = [], []
    for k, part in enumerate(parts):
        n, t = _with_axes("Unsqueeze", part, [axis], f"{prefix}{target}/{k}", opset)
        nodes += n
        inits += t
    nodes.append(helper.make_node("Concat", [u.output[0] for u in nodes], [target], axis=axis,
                                  name=f"{prefix}{target}/out"))
    return nodes, inits


def _unstack(src: str, axis: int, length: int, name: str, opset: int) -> tuple[list, list, list[str]]:
    """The ``length`` slices of ``src`` along ``axis``, that axis dropped (Split, Squeeze each)."""
    parts = [f"{name}/{k}" for k in range(length)]
    extra = {"num_outputs": length} if opset >= 18 else {}
    nodes, inits = [helper.make_node("Split", [src], [f"{p}/split" for p in parts], axis=axis, name=name, **extra)], []
    for part in parts:
        n, t = _with_axes("Squeeze", f"{part}/split", [axis], part, opset)
        nodes += n
        inits += t
    return nodes, inits, parts


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
        nodes.append(_identity(mapping.get(out.name, out.name), target, prefix))
    return nodes, inits


def _unroll_loop(node, consts, prefix, opset) -> tuple[list, list]:
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
    body_consts = constants(body)
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
        n, t, outs = _instance(body, p, mapping)
        nodes += n
        inits += t
        carried = outs[1:1 + n_carried]
        for k, name in enumerate(outs[1 + n_carried:]):
            scans[k].append(name)
    for src, target in zip(carried, node.output[:n_carried]):
        if target:
            nodes.append(_identity(src, target, prefix))
    for parts, target in zip(scans, node.output[n_carried:]):
        if target:
            n, t = _stack(parts, target, 0, prefix, opset)
            nodes += n
            inits += t
    return nodes, inits


def static_shapes(graph: onnx.GraphProto) -> dict[str, tuple[int, ...]]:
    """The tensors of ``graph`` whose shape is known to be all numbers (inferred or constant)."""
    shapes = {name: tuple(v.shape) for name, v in constants(graph).items()}
    for vi in [*graph.input, *graph.value_info, *graph.output]:
        t = vi.type.tensor_type
        if t.HasField("shape") and all(d.HasField("dim_value") for d in t.shape.dim):
            shapes[vi.name] = tuple(d.dim_value for d in t.shape.dim)
    return shapes


def _scan_attrs(node: onnx.NodeProto) -> tuple[onnx.GraphProto, int, dict[str, list[int]]]:
    attrs = {a.name: a for a in node.attribute}
    n_in = attrs["num_scan_inputs"].i
    body = attrs["body"].g
    n_out = len(body.output) - (len(node.input) - n_in)
    lists = {}
    for name, count in [("scan_input_directions", n_in), ("scan_input_axes", n_in),
                        ("scan_output_directions", n_out), ("scan_output_axes", n_out)]:
        lists[name] = list(attrs[name].ints) if name in attrs else [0] * count
        if len(lists[name]) != count:
            raise UnsupportedOperatorError(f"node {node.name!r} (Scan): {name} has {len(lists[name])} entries, "
                                           f"not {count}")
    return body, n_in, lists


def _scan_length(node, shapes) -> tuple[int | None, str]:
    """The Scan's sequence length, or None with the scan input whose length is not static."""
    _, n_in, attrs = _scan_attrs(node)
    lengths = {}
    for name, axis in zip(node.input[len(node.input) - n_in:], attrs["scan_input_axes"]):
        if name not in shapes:
            return None, name
        rank = len(shapes[name])
        if not -rank <= axis < rank:
            raise UnsupportedOperatorError(f"node {node.name!r} (Scan): scan axis {axis} is out of range for "
                                           f"input {name!r} of rank {rank}")
        lengths[name] = shapes[name][axis]
    if len(set(lengths.values())) > 1:
        raise UnsupportedOperatorError(f"node {node.name!r} (Scan): the scan inputs differ in length: {lengths}")
    return next(iter(lengths.values())), next(iter(lengths))


def _unroll_scan(node, length, prefix, opset) -> tuple[list, list]:
    body, n_in, attrs = _scan_attrs(node)
    n_state = len(node.input) - n_in
    if opset < 9:
        raise UnsupportedOperatorError(f"node {node.name!r} (Scan): opset {opset} Scan (batched, with "
                                       "sequence_lens) is not supported; re-export with opset 9 or later")
    if length > MAX_UNROLL:
        raise UnsupportedOperatorError(f"node {node.name!r} (Scan): {length} iterations (the length of scan input "
                                       f"{node.input[n_state]!r}) exceed the unroll limit {MAX_UNROLL}")
    scans: list[list[str]] = [[] for _ in attrs["scan_output_axes"]]
    if length == 0 and scans:
        raise UnsupportedOperatorError(f"node {node.name!r} (Scan): zero iterations with scan outputs")
    nodes, inits, steps = [], [], []
    inputs = zip(body.input[n_state:], node.input[n_state:], attrs["scan_input_axes"]) if length else []
    for vi, src, axis in inputs:
        n, t, parts = _unstack(src, axis, length, f"{prefix}{vi.name}", opset)
        nodes += n
        inits += t
        steps.append(parts)
    state = list(node.input[:n_state])
    for i in range(length):
        p = f"{prefix}iter{i}/"
        mapping = {vi.name: s for vi, s in zip(body.input, state)}
        for vi, parts, rev in zip(body.input[n_state:], steps, attrs["scan_input_directions"]):
            mapping[vi.name] = parts[length - 1 - i if rev else i]
        n, t, outs = _instance(body, p, mapping)
        nodes += n
        inits += t
        state = outs[:n_state]
        for k, name in enumerate(outs[n_state:]):
            scans[k].append(name)
    for src, target in zip(state, node.output[:n_state]):
        if target:
            nodes.append(_identity(src, target, prefix))
    for parts, target, axis, rev in zip(scans, node.output[n_state:], attrs["scan_output_axes"],
                                        attrs["scan_output_directions"]):
        if target:
            n, t = _stack(parts[::-1] if rev else parts, target, axis, prefix, opset)
            nodes += n
            inits += t
    return nodes, inits


def inline_control_flow(model: onnx.ModelProto) -> bool:
    """Replace ``If`` nodes with a constant condition by the taken branch and unroll ``Loop``s with a
    constant trip count and ``Scan``s of static length; returns whether anything changed. Run-time
    conditions and lengths are left alone (``check_control_flow`` names them)."""
    graph = model.graph
    consts, shapes = constants(graph), static_shapes(graph)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    changed, new_nodes = False, []
    for k, node in enumerate(graph.node):
        prefix = f"{node.name or node.op_type}#{k}/"
        if node.op_type == "If" and node.input[0] in consts:
            nodes, inits = _inline_if(node, consts, prefix)
        elif node.op_type == "Loop" and (not node.input[0] or node.input[0] in consts):
            nodes, inits = _unroll_loop(node, consts, prefix, opset)
        elif node.op_type == "Scan" and (length := _scan_length(node, shapes)[0]) is not None:
            nodes, inits = _unroll_scan(node, length, prefix, opset)
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


def _shape_sources(graph: onnx.GraphProto, tensor: str, shapes: dict, consts: dict) -> list[str]:
    """The model inputs that keep ``tensor``'s shape from being static: back through tensors of
    unknown shape to the shape-like inputs (``SHAPE_INPUTS``) that did not fold."""
    producers = {o: n for n in graph.node for o in n.output}
    seen, stack, found = set(), [tensor], set()
    while stack:
        name = stack.pop()
        if name in seen or name in shapes or name not in producers:
            continue
        seen.add(name)
        node = producers[name]
        roles = SHAPE_INPUTS.get(node.op_type, {})
        for pos, inp in enumerate(node.input):
            if pos in roles and inp and inp not in consts:
                found.update(dynamic_sources(graph, inp))
            elif pos not in roles:
                stack.append(inp)
    # A data-dependent op (NonZero, ...) has no shape-like input: name what feeds it.
    return sorted(found) or dynamic_sources(graph, tensor)


def check_control_flow(model: onnx.ModelProto) -> None:
    """Control flow left after folding is decided at run time: name the node and its input."""
    graph = model.graph
    for node in graph.node:
        if node.op_type == "Scan":
            shapes = static_shapes(graph)
            _, name = _scan_length(node, shapes)
            sources = _shape_sources(graph, name, shapes, constants(graph))
            why = f" (computed at run time from model input(s) {', '.join(map(repr, sources))})" if sources else ""
            raise UnsupportedOperatorError(
                f"node {node.name!r} (Scan): the length of its scan input {name!r} is not static{why}; "
                "souffle-tvm unrolls Scan over a sequence whose length is known at compile time only")
        if node.op_type in ("If", "Loop"):
            role = {"If": "condition", "Loop": "trip count"}[node.op_type]
            sources = dynamic_sources(graph, node.input[0]) if node.input and node.input[0] else []
            why = f" (computed from model input(s) {', '.join(map(repr, sources))})" if sources else ""
            fix = (f": if {' and '.join(map(repr, sources))} is always the same value, fix it with "
                   f"--bind {sources[0]}=VALUE (bind={{{sources[0]!r}: value}})") if sources else ""
            raise UnsupportedOperatorError(
                f"node {node.name!r} ({node.op_type}): its {role} does not fold to a constant{why}; "
                f"souffle-tvm compiles static graphs only: control flow must be decided at compile time{fix}")
