"""ONNX → Relax: load, validate and import a model, with clear errors for bad input.

Adds this project's converters (``onnx_rnn``) to TVM's importer for the duration of an import.
Weights stay out of the IR: they are detached as parameters, passed after the model inputs.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import onnx
import tvm
from google.protobuf.message import DecodeError
from tvm import relax
from tvm.relax.frontend.onnx import from_onnx
from tvm.relax.frontend.onnx import onnx_frontend as _onnx

from . import accumulation, binding, names as c_names, onnx_bn, onnx_control, onnx_fold, onnx_forms, onnx_rnn, precision
from .onnx_graph import NP_DTYPES, check_structure
from ..errors import DynamicShapeError, ModelLoadError, SouffleError, UnknownInputError, UnsupportedOperatorError


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass
class ImportedModel:
    """A model in Relax: ``mod["main"]`` takes ``inputs`` then ``params`` (in that order).

    ``main``'s parameters are C identifiers (``names``); ``inputs`` keep the ONNX names, and
    ``names`` maps each renamed parameter back to the name TVM's importer gave it (the ONNX name,
    less an ``onnx::`` prefix).
    """

    name: str
    mod: tvm.IRModule
    params: list[np.ndarray]
    inputs: list[TensorInfo]
    outputs: list[str]
    onnx_model: onnx.ModelProto = field(repr=False)
    names: dict[str, str] = field(default_factory=dict)
    precision: str = "float32"      # what its floats compute in (``--dtype``); ``onnx_model`` is the reference


def load_model(source: str | os.PathLike | onnx.ModelProto, small: bool = False,
               dtype: str = "float32") -> tuple[str, onnx.ModelProto]:
    """Return ``(name, ModelProto)`` for an ONNX file path, a ModelProto or a zoo model name."""
    from .. import zoo

    if isinstance(source, onnx.ModelProto):
        return source.graph.name or "model", source
    path = os.fspath(source)
    if not os.path.isfile(path) and path in zoo.MODELS:
        name = path + ("-small" if small else "") + {"float16": "-fp16", "bfloat16": "-bf16"}.get(dtype, "")
        # a zoo model not built in ``dtype`` is built in float32 and converted (``precision``)
        native = dtype if dtype in zoo.MODELS[path].dtypes or dtype not in precision.DTYPES else "float32"
        return name, zoo.build(path, small=small, dtype=native)
    if not os.path.exists(path):
        raise ModelLoadError(f"{path}: no such file, and not a zoo model ({', '.join(zoo.names())})")
    if os.path.isdir(path):
        raise ModelLoadError(f"{path}: is a folder; give an .onnx file (or a zoo model name)")
    try:
        with open(path, "rb") as f:
            model = onnx.load_model_from_string(f.read())
    except (DecodeError, ValueError, RuntimeError) as err:
        raise ModelLoadError(f"{path}: not a readable ONNX model (truncated or corrupt file?): {err}") from err
    if not model.graph.node:
        raise ModelLoadError(f"{path}: the ONNX graph is empty (truncated or not an ONNX model?)")
    _load_external_data(model, path)
    return os.path.splitext(os.path.basename(path))[0], model


def _load_external_data(model: onnx.ModelProto, path: str) -> None:
    """Read weights stored beside the model (``X.onnx.data``, as PyTorch's dynamo exporter writes)."""
    from onnx.external_data_helper import load_external_data_for_model, uses_external_data

    if not any(uses_external_data(t) for t in model.graph.initializer):
        return
    folder = os.path.dirname(os.path.abspath(path))
    for t in model.graph.initializer:
        location = next((e.value for e in t.external_data if e.key == "location"), None) \
            if uses_external_data(t) else None
        if location and not os.path.isfile(os.path.join(folder, location)):
            raise ModelLoadError(f"{path}: its weights are stored in a separate file, {location}, which is missing "
                                 f"from {folder} (keep it beside the model)")
    try:
        load_external_data_for_model(model, os.path.dirname(os.path.abspath(path)))
    except (OSError, ValueError, onnx.checker.ValidationError) as err:
        raise ModelLoadError(f"{path}: its weights are stored in a separate file that could not be read "
                             f"(keep the .data file beside the model): {err}") from err


def graph_inputs(model: onnx.ModelProto, shapes: dict[str, tuple[int, ...]] | None = None) -> list[TensorInfo]:
    """The model's true inputs (initializers excluded), with static shapes; a DynamicShapeError
    where one is left dynamic, an UnknownInputError where ``shapes`` names no input."""
    shapes = shapes or {}
    inits = {t.name for t in model.graph.initializer}
    true_inputs = [vi for vi in model.graph.input if vi.name not in inits]
    unknown = [n for n in shapes if n not in {vi.name for vi in true_inputs}]
    if unknown:
        listed = ", ".join(repr(vi.name) for vi in true_inputs) or "none"
        raise UnknownInputError(f"shapes given for {', '.join(map(repr, unknown))}, which the model does not "
                                f"have as input{'s' if len(unknown) > 1 else ''} (its inputs: {listed})",
                                unknown, [vi.name for vi in true_inputs])
    infos, dynamic = [], {}
    for vi in true_inputs:
        tt = vi.type.tensor_type
        dtype = NP_DTYPES.get(tt.elem_type)
        if dtype is None:
            raise UnsupportedOperatorError(f"input {vi.name!r} has unsupported element type "
                                           f"{onnx.TensorProto.DataType.Name(tt.elem_type)}")
        if vi.name in shapes:
            infos.append(TensorInfo(vi.name, tuple(int(d) for d in shapes[vi.name]), dtype))
            continue
        dims = tuple(d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else (d.dim_param or "?")
                     for d in tt.shape.dim)
        if any(isinstance(d, str) for d in dims):
            dynamic[vi.name] = dims
        infos.append(TensorInfo(vi.name, dims, dtype))
    if dynamic:
        name, dims = next(iter(dynamic.items()))
        i = next(i for i, d in enumerate(dims) if isinstance(d, str))
        raise DynamicShapeError(
            f"input {name!r} has a dynamic dimension {i} ({dims[i]!r}); souffle-tvm compiles "
            f"static shapes only: export with fixed sizes or give the shape "
            f"(shapes={{'{name}': (...)}})", dynamic)
    return infos


def input_types(model: onnx.ModelProto) -> dict[str, str]:
    """The model's true inputs (initializers excluded) by name, with their numpy dtype names
    (``"?"`` for an element type the importer does not take)."""
    inits = {t.name for t in model.graph.initializer}
    return {vi.name: NP_DTYPES.get(vi.type.tensor_type.elem_type, "?") for vi in model.graph.input
            if vi.name not in inits}


def check_opsets(name: str, model: onnx.ModelProto) -> None:
    """Refuse a default-domain opset newer than the installed onnx knows: its operators'
    meaning (and onnxruntime's) is unknown, and TVM's converters would silently apply the
    newest rules they have."""
    newest = onnx.defs.onnx_opset_version()
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx") and imp.version > newest:
            raise ModelLoadError(f"{name}: the model imports opset {imp.version} of the default ONNX domain; "
                                 f"this importer knows opsets up to {newest} (onnx {onnx.__version__}): "
                                 f"export with opset {newest} or older")


@contextlib.contextmanager
def native_stderr_held() -> Iterator[None]:
    """Hold back what is written to file descriptor 2 (TVM's C++ log, onnxruntime's) during the
    block: replayed if the block succeeds, dropped if it raises, so that a refusal's one-line
    message is not surrounded by the warnings the failure left (a half-built BlockBuilder's)."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):       # no usable fd 2 (a closed or replaced stderr): hold nothing
        saved = None
    if saved is None:
        yield
        return
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        ok = False
        try:
            yield
            ok = True
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if ok:
                held.seek(0)
                text = held.read()
                if text:
                    os.write(2, text)


def shapes_from_arrays(model: onnx.ModelProto, arrays: dict[str, np.ndarray]) -> dict[str, tuple[int, ...]]:
    """Shapes for the model's inputs with dynamic dims, taken from the given arrays (``run --inputs``).

    Inputs whose dims are all static keep them: an array of another shape is then reported as a
    mismatch by the run, rather than silently recompiling the model for it.
    """
    inits = {t.name for t in model.graph.initializer}
    shapes = {}
    for vi in model.graph.input:
        if vi.name in inits or vi.name not in arrays:
            continue
        dims = vi.type.tensor_type.shape.dim
        if any(not d.HasField("dim_value") or d.dim_value <= 0 for d in dims):
            shapes[vi.name] = tuple(int(n) for n in np.shape(arrays[vi.name]))
    return shapes


@contextlib.contextmanager
def _project_converters(fp16_accumulation: str = "float16"):
    """Temporarily extend TVM's ONNX converter table with ours."""
    original = _onnx._get_convert_map
    extra = onnx_forms.FLOAT32_ACCUMULATION if fp16_accumulation == "float32" else {}
    _onnx._get_convert_map = lambda: {**original(), **onnx_forms.CONVERTERS, **extra, **onnx_rnn.CONVERTERS}
    try:
        yield
    finally:
        _onnx._get_convert_map = original


def supported_ops() -> set[str]:
    with _project_converters():
        return set(_onnx._get_convert_map()) | {"Constant", "If"}


def check_operators(model: onnx.ModelProto) -> None:
    known = supported_ops()
    missing: dict[str, str] = {}
    for node in model.graph.node:
        if node.domain not in ("", "ai.onnx"):
            missing.setdefault(f"{node.domain}::{node.op_type}", node.name)
        elif node.op_type not in known:
            missing.setdefault(node.op_type, node.name)
    if missing:
        listed = ", ".join(f"{op} (node {name!r})" for op, name in missing.items())
        raise UnsupportedOperatorError(f"unsupported ONNX operator(s): {listed}")


def _as_tvm_reads_it(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` in the form TVM's importer reads correctly.

    * Initializers are not graph inputs. Files of IR version 3 (early exporters, the classic
      model-zoo CNNs) list every initializer among the inputs too, its value being the input's
      default; TVM's importer then makes it a parameter twice (as an input and as a weight).
    * Integer and bool initializers are ``Constant`` nodes. TVM's importer makes every
      initializer a parameter (``keep_params_in_input``) and only some converters look a
      parameter up as a constant; the others (``Expand``'s shape: transformers' attention mask
      ``mask[:, None, None, :].expand(b, 1, s, s)``, whose shape the folding made an int64
      initializer) build a dynamic-shape graph that cannot be folded or lowered. Shapes,
      indices and masks are never weights.
    """
    g = model.graph
    inits = {t.name for t in g.initializer}
    ints = {t.name for t in g.initializer if np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type)).kind in "iub"}
    if not ints and not any(vi.name in inits for vi in g.input):
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    consts = [onnx.helper.make_node("Constant", [], [t.name], value=t) for t in g.initializer if t.name in ints]
    keep = [t for t in g.initializer if t.name not in ints]
    del g.initializer[:]
    g.initializer.extend(keep)
    inputs = [vi for vi in g.input if vi.name not in inits]
    del g.input[:]
    g.input.extend(inputs)
    nodes = consts + list(g.node)
    del g.node[:]
    g.node.extend(nodes)
    out.ir_version = max(out.ir_version, 4)     # initializers that are not inputs need IR version 4
    return out


def _bind_integer_params(mod: tvm.IRModule, params: dict, fold: bool = False) -> tuple[tvm.IRModule, list[np.ndarray]]:
    """Bind integer/bool initializers (indices, shapes, masks) as constants and fold what they feed
    (``fold``: fold constants even if none is left to bind, as when the model's integer
    initializers reached the importer as constants already).

    They are not weights: exporters use them for Gather indices and shape arithmetic, which
    should fold at compile time rather than run as kernels.
    """
    func = mod["main"]
    num_input = int(func.attrs["num_input"])
    values = params.get("main", [])
    keep, bind = [], {}
    for p, v in zip(func.params[num_input:], values):
        if str(v.dtype).startswith(("int", "uint", "bool")):
            bind[p] = relax.const(v.numpy(), str(v.dtype))
        else:
            keep.append(v.numpy())
    if bind:
        mod = relax.transform.BindParams("main", bind)(mod)
    if bind or fold:
        mod = relax.transform.FoldConstant()(mod)
    return mod, keep


def _typed_outputs(name: str, model: onnx.ModelProto) -> onnx.ModelProto:
    """Graph outputs declared without a type or shape (onnxruntime runs such models; the strict
    checker rejects them) get the ones shape inference gives, or a clear error."""
    def untyped(vi) -> bool:
        return not vi.type.HasField("tensor_type") or not vi.type.tensor_type.HasField("shape") \
            or vi.type.tensor_type.elem_type == onnx.TensorProto.UNDEFINED

    if not any(untyped(o) for o in model.graph.output):
        return model
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except (onnx.shape_inference.InferenceError, ValueError) as err:
        raise ModelLoadError(f"{name}: outputs declared without a shape, and shape inference failed: {err}") from None
    missing = [o.name for o in inferred.graph.output if untyped(o)]
    if missing:
        raise ModelLoadError(f"{name}: output(s) {', '.join(map(repr, missing))} have no declared type or shape "
                             "and shape inference cannot give one: declare them in the exported graph")
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.output[:]
    out.graph.output.extend(inferred.graph.output)
    return out


def import_onnx(source, shapes: dict[str, tuple[int, ...]] | None = None, small: bool = False,
                dtype: str = "float32", fold: bool = True, bind: dict[str, object] | None = None,
                fp16_accumulation: str = "float16") -> ImportedModel:
    """Load, validate and import an ONNX model into Relax with its weights detached.

    With ``fold`` (the default) the model's run-time shape arithmetic and constant control flow
    are folded first, for the static input shapes (``onnx_fold``); ``fold=False`` hands the
    graph to TVM's importer as it is. ``bind`` fixes model inputs to values (``binding``): they
    are no longer inputs. ``ImportedModel.onnx_model`` stays the unfolded model (with the bound
    values), so a reference run checks the folding too. ``fp16_accumulation="float32"``: float16
    MatMul/Gemm/Conv/ConvTranspose accumulate in float32, as ONNX's reference does (the ONNX
    backend's choice); the default ``"float16"`` keeps them in float16.
    """
    if fp16_accumulation not in ("float16", "float32"):
        raise ValueError(f"fp16_accumulation {fp16_accumulation!r}: 'float16' or 'float32'")
    name, model = load_model(source, small=small, dtype=dtype)
    check_opsets(name, model)
    check_structure(name, model.graph)
    model = binding.bind_inputs(model, bind or {})
    model = _typed_outputs(name, model)
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as err:
        raise ModelLoadError(f"{name}: invalid ONNX model: {str(err).splitlines()[0]}") from err
    inputs = graph_inputs(model, shapes)
    converted = model
    if fold and onnx_fold.needs_folding(model):
        converted = onnx_fold.fold(model, {i.name: i.shape for i in inputs})
    elif fold:  # nothing to fold, but data-dependent shapes still get a clear error, not TVM's
        onnx_control.check_control_flow(model)
        onnx_fold.check_static(model)
    if precision.needs_conversion(converted, dtype):
        converted = precision.convert(converted, dtype)     # folded in float32 first: onnxruntime folds it
    check_operators(converted)
    onnx_forms.check_forms(converted)
    converted, _ = onnx_bn.fold_batch_norms(converted)
    # integer initializers fed FoldConstant when they were bound after the import; as constants
    # they still do (the same folding, whichever way they arrive)
    has_ints = any(np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type)).kind in "iub"
                   for t in converted.graph.initializer)
    converted = _as_tvm_reads_it(converted)
    failure = None
    with native_stderr_held():
        try:
            with _project_converters(fp16_accumulation):
                mod = from_onnx(converted, shape_dict={i.name: list(i.shape) for i in inputs},
                                dtype_dict={i.name: i.dtype for i in inputs}, keep_params_in_input=True)
        except SouffleError:
            raise
        except Exception as err:  # TVM raises many types; name the failure
            failure = (f"{name}: TVM's ONNX importer failed: {type(err).__name__}: "
                       f"{str(err).strip().splitlines()[-1] if str(err).strip() else err}")
        if failure is not None:
            # Outside the handler nothing keeps the failed import's frames alive: its half-built
            # BlockBuilder goes now, while stderr is held, and TVM's "destroyed with remaining
            # blocks" warning is dropped with it rather than printed around our message.
            gc.collect()
            raise UnsupportedOperatorError(failure)
    try:
        mod, weights = _bind_integer_params(*relax.frontend.detach_params(mod), fold=has_ints)
    except Exception as err:  # noqa: BLE001 - TVM's folding asserts on shapes it cannot evaluate
        raise UnsupportedOperatorError(
            f"{name}: the imported graph keeps shapes known only at run time, which cannot be folded "
            f"({type(err).__name__}: {(str(err).strip().splitlines() or [''])[-1][:200]}); give static input "
            "shapes (--input-shapes) or export without data-dependent shapes") from None
    if precision.compute_dtype(converted) == "bfloat16":    # converted or exported so: no bf16 accumulator exists
        mod = accumulation.accumulate_in_float32(mod)
    mod, renamed = c_names.rename_params(mod)
    outputs = [o.name for o in model.graph.output]
    return ImportedModel(name, mod, weights, inputs, outputs, model, renamed, precision.compute_dtype(converted))
