"""Run a compiled model on the CPU and compare it with a reference runtime.

The reference is onnxruntime (a test-only dependency); where it is not installed,
``onnx.reference.ReferenceEvaluator`` (slow, and seen wrong on some real models).
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from ..errors import SouffleError
from ..frontend.importer import TensorInfo
from .numerics import Comparison, compare, default_tolerance, random_inputs, reference_outputs

__all__ = ["Comparison", "compare", "default_tolerance", "random_inputs", "reference_outputs",
           "check_feeds", "run_vm"]


def check_feeds(infos: list[TensorInfo], feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The model's inputs in order, validated against names, shapes and dtypes."""
    ordered = []
    for info in infos:
        if info.name not in feeds:
            raise SouffleError(f"input {info.name!r} missing from the given inputs ({', '.join(feeds) or 'none'})")
        arr = np.asarray(feeds[info.name])
        if tuple(arr.shape) != tuple(info.shape):
            raise SouffleError(f"input {info.name!r} has shape {arr.shape}, the model expects {info.shape}")
        ordered.append(arr.astype(info.dtype, copy=False))
    return ordered


def run_vm(executable, params: list[np.ndarray], inputs: list[np.ndarray]) -> list[np.ndarray]:
    """Run ``main`` on the CPU through Relax's VM; returns the outputs as numpy arrays."""
    vm = relax.VirtualMachine(executable, tvm.cpu())
    args = [tvm.runtime.tensor(a) for a in inputs] + [tvm.runtime.tensor(p) for p in params]
    out = vm["main"](*args)
    return _flatten(out)


def _flatten(out) -> list[np.ndarray]:
    if hasattr(out, "numpy"):
        return [out.numpy()]
    return [a for item in out for a in _flatten(item)]


