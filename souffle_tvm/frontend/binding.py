"""Model inputs fixed to a value at compile time (``--bind NAME=VALUE``).

A model that branches on a configuration input (an ``If`` whose condition is computed from
it) is static once that input is known: bound inputs become initializers before folding, so
their ``If``/``Loop`` fold like any constant. The reference model keeps the same values, so a
check against onnxruntime runs what was compiled.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from ..errors import ModelLoadError
from .onnx_graph import NP_DTYPES



def parse_bind(items: list[str] | None) -> dict[str, object]:
    """``["NAME=VALUE", ...]`` → {name: value}: a number, true/false, or a ``.npy`` file's array."""
    out: dict[str, object] = {}
    for item in items or []:
        name, sep, text = item.partition("=")
        if not sep or not name or not text:
            raise ModelLoadError(f"--bind {item!r} is not NAME=VALUE (a number, true/false, or an array.npy)")
        if text.endswith(".npy"):
            try:
                out[name] = np.load(text, allow_pickle=False)
            except (OSError, ValueError) as err:
                raise ModelLoadError(f"--bind {name}: cannot read {text}: {err}") from None
        elif text.lower() in ("true", "false"):
            out[name] = text.lower() == "true"
        else:
            try:
                out[name] = int(text)
            except ValueError:
                try:
                    out[name] = float(text)
                except ValueError:
                    raise ModelLoadError(f"--bind {name}: {text!r} is neither a number, true/false, "
                                         "nor a .npy file") from None
    return out


def bind_inputs(model: onnx.ModelProto, values: dict[str, object]) -> onnx.ModelProto:
    """A copy of ``model`` whose inputs named in ``values`` are initializers with those values
    (converted to the input's element type; the shape must match the declared one)."""
    if not values:
        return model
    inputs = {vi.name: vi for vi in model.graph.input}
    inits = {t.name for t in model.graph.initializer}
    unknown = [n for n in values if n not in inputs or n in inits]
    if unknown:
        real = [vi.name for vi in model.graph.input if vi.name not in inits]
        raise ModelLoadError(f"--bind {unknown[0]!r}: the model has no such input (inputs: {', '.join(real)})")
    out = onnx.ModelProto()
    out.CopyFrom(model)
    keep = []
    for vi in out.graph.input:
        if vi.name not in values:
            keep.append(vi)
            continue
        tt = vi.type.tensor_type
        np_type = NP_DTYPES.get(tt.elem_type)
        if np_type is None:
            raise ModelLoadError(f"--bind {vi.name!r}: inputs of element type "
                                 f"{onnx.TensorProto.DataType.Name(tt.elem_type)} cannot be bound")
        value = np.asarray(values[vi.name]).astype(np_type)
        declared = [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None for d in tt.shape.dim]
        if tt.HasField("shape") and (len(declared) != value.ndim or
                                     any(d is not None and d != s for d, s in zip(declared, value.shape))):
            shown = "x".join("?" if d is None else str(d) for d in declared) or "a scalar"
            raise ModelLoadError(f"--bind {vi.name!r}: a value of shape {value.shape} for an input declared "
                                 f"as {shown}")
        out.graph.initializer.append(numpy_helper.from_array(value, vi.name))
    del out.graph.input[:]
    out.graph.input.extend(keep)
    if out.ir_version < 4:      # initializers that are not inputs need IR version 4
        out.ir_version = 4
    return out
