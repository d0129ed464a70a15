"""souffle-tvm: Souffle (ASPLOS 2024) as a TVM extension.

``souffle_tvm.compile(model, target, fusion=...)`` is the one-call API; ``souffle-tvm`` the CLI.
"""

from .api import Compiled, compile
from .errors import (DynamicShapeError, ModelLoadError, SouffleError, ToolchainError,
                     UnsupportedOperatorError)
from .report import Report

__version__ = "0.1.0"

__all__ = ["compile", "Compiled", "Report", "SouffleError", "ModelLoadError", "UnsupportedOperatorError",
           "DynamicShapeError", "ToolchainError", "__version__"]
