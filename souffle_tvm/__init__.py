"""souffle-tvm: Souffle (ASPLOS 2024) as a TVM extension.

``souffle_tvm.compile(model, target, fusion=...)`` is the one-call API; ``souffle-tvm`` the CLI;
``souffle_tvm.transform`` (``import souffle_tvm.transform``) the passes, for a user's own ``tvm.compile``.

The compiler entry points are imported lazily: ``souffle_tvm.zoo``, ``souffle_tvm.runtime.numerics``
and ``souffle_tvm.runtime.standalone`` work where only numpy/onnx and the TVM *runtime* exist (the
GPU machine the device check runs on).
"""

from .errors import DynamicShapeError, ModelLoadError, SouffleError, ToolchainError, UnsupportedOperatorError

__version__ = "0.1.0"

__all__ = ["compile", "Compiled", "Report", "SouffleError", "ModelLoadError", "UnsupportedOperatorError",
           "DynamicShapeError", "ToolchainError", "__version__"]

def __getattr__(name: str):
    # Lazy, so that ``zoo``, ``runtime.numerics`` and ``runtime.standalone`` import without
    # TVM's compiler (the GPU machine has only its runtime).
    if name in ("compile", "Compiled"):
        from .pipeline import driver

        return getattr(driver, name)
    if name == "Report":
        from .report.schema import Report

        return Report
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
