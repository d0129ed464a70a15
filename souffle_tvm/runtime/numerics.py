"""Numerics without TVM: seeded inputs, the reference runtime, relative-L2 comparison.

Kept free of TVM imports so the GPU check (python/gpu_check.py) can use it on a machine that
has only the TVM runtime libraries.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import SouffleError


def random_inputs(infos: list, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded inputs for ``infos`` (objects with name, shape, dtype): N(0, 1) floats, small non-negative ints (valid ids/indices), random bools."""
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


def reference_outputs(model, feeds: dict[str, np.ndarray]) -> tuple[str, list[np.ndarray]]:
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
    """Relative L2 bound against a reference for a model computing in ``dtype``."""
    return {"float16": 1e-2, "bfloat16": 5e-2}.get(dtype, 1e-5)
