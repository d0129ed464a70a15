"""Run a compiled model on the CPU and compare it with a reference runtime.

The reference is onnxruntime (a test-only dependency); where it is not installed,
``onnx.reference.ReferenceEvaluator`` (slow, and seen wrong on some real models).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import tvm
from tvm import relax

from .errors import SouffleError
from .frontend import TensorInfo


def random_inputs(infos: list[TensorInfo], seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded inputs: N(0, 1) floats, small non-negative ints (valid ids/indices), random bools."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for info in infos:
        if info.dtype.startswith("float"):
            feeds[info.name] = rng.standard_normal(info.shape).astype(info.dtype)
        elif info.dtype == "bool":
            feeds[info.name] = rng.random(info.shape) < 0.5
        else:
            feeds[info.name] = rng.integers(0, 2, info.shape).astype(info.dtype)
    return feeds


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


def reference_outputs(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> tuple[str, list[np.ndarray]]:
    """Outputs of the reference runtime: ``("onnxruntime", outs)`` or the ONNX reference evaluator."""
    try:
        import onnxruntime as ort
    except ImportError:
        from onnx.reference import ReferenceEvaluator

        return "onnx.reference", list(ReferenceEvaluator(model).run(None, feeds))
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return "onnxruntime", sess.run(None, feeds)


@dataclass
class Comparison:
    name: str
    rel_l2: float
    max_abs: float
    finite: bool

    def ok(self, tol: float) -> bool:
        return self.finite and self.rel_l2 < tol


def compare(names: list[str], got: list[np.ndarray], want: list[np.ndarray]) -> list[Comparison]:
    if len(got) != len(want):
        raise SouffleError(f"the model produced {len(got)} outputs, the reference {len(want)}")
    out = []
    for name, g, w in zip(names, got, want):
        g64, w64 = np.asarray(g, np.float64), np.asarray(w, np.float64)
        if g64.shape != w64.shape:
            raise SouffleError(f"output {name!r}: shape {g64.shape} vs reference {w64.shape}")
        denom = max(np.linalg.norm(w64), 1e-30)
        out.append(Comparison(name, float(np.linalg.norm(g64 - w64) / denom),
                              float(np.max(np.abs(g64 - w64))) if g64.size else 0.0,
                              bool(np.all(np.isfinite(g64)))))
    return out


def default_tolerance(dtype: str) -> float:
    return 1e-2 if dtype == "float16" else 1e-5
