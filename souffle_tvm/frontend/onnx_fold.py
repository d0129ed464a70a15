"""Fold an exported ONNX model's run-time shape arithmetic into constants before TVM imports it.

PyTorch's exporters write ``x.view(b, n, h, d)`` as Shape→Gather→Concat→Reshape, padding
amounts as Sub/Mod chains feeding Pad, zeros as ConstantOfShape(Shape(x)), and so on. TVM's
Relax importer fails on many of these ("Reshape requires the input new shape to be Shape",
"Dynamic pads are not supported yet", ...). Once every model input has a static shape, all of
that is compile-time arithmetic: this module fixes the input shapes in the graph, lets
onnxslim (shape inference + constant folding) evaluate it, inlines ``If`` branches and unrolls
``Loop``s and ``Scan``s whose condition / trip count / length became constants (``onnx_control``),
and then checks that every input that must be static (a new shape, pads, repeats, slice bounds,
...) is. What cannot be folded is reported by node, naming the model input that keeps it dynamic.
"""

from __future__ import annotations

import logging

import onnx

from ..errors import DynamicShapeError, UnsupportedOperatorError
from .onnx_control import check_control_flow, inline_control_flow
from .onnx_graph import SHAPE_INPUTS, constants, dynamic_sources

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


def check_static(model: onnx.ModelProto) -> None:
    """Raise a DynamicShapeError for the first node whose shape-like input depends on a model input."""
    graph = model.graph
    consts = constants(graph)
    for node in graph.node:
        for pos, role in SHAPE_INPUTS.get(node.op_type, {}).items():
            if pos >= len(node.input) or not node.input[pos] or node.input[pos] in consts:
                continue
            sources = dynamic_sources(graph, node.input[pos])
            if not sources:  # computed from weights only: TVM's importer evaluates that itself
                continue
            where = f"it is computed at run time from model input(s) {', '.join(map(repr, sources))}"
            raise DynamicShapeError(
                f"node {node.name or node.output[0]!r} ({node.op_type}): its {role} input {node.input[pos]!r} "
                f"could not be folded to a constant; {where}. souffle-tvm compiles static graphs only: "
                "fix the input shapes (--input-shapes / shapes=) or export without data-dependent shapes")


def _slim(model: onnx.ModelProto) -> onnx.ModelProto:
    import onnxslim

    # Graph fusion is left to TVM (onnxslim's patterns can emit non-standard ops); only folding,
    # shape inference, and dead-code / common-subexpression elimination are wanted here.
    logging.getLogger("onnxslim").setLevel(logging.ERROR)
    return onnxslim.slim(model, skip_optimizations=["graph_fusion"])


# Ops whose presence means the graph computes shapes or control decisions at run time.
_RUN_TIME_OPS = {"Shape", "Size", "If", "Loop", "Scan"}


def needs_folding(model: onnx.ModelProto) -> bool:
    """Whether the graph has run-time shape arithmetic or control flow for ``fold`` to resolve,
    or a shape-like input (pads, a new shape, repeats, ...) computed from constants by nodes:
    torch's legacy exporter writes ``F.pad``'s amounts as ConstantOfShape/Concat/Reshape/Slice/
    Transpose/Cast over constants, and TVM's importer takes any computed pads as dynamic.

    Graphs without any (hand-built or already simplified ones, the zoo's) go to TVM untouched,
    so folding never rewrites a model that imports as it is.
    """
    graph = model.graph
    if any(n.op_type in _RUN_TIME_OPS for n in graph.node):
        return True
    consts = constants(graph)
    return any(pos < len(n.input) and n.input[pos] and n.input[pos] not in consts
               for n in graph.node for pos in SHAPE_INPUTS.get(n.op_type, {}))


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
