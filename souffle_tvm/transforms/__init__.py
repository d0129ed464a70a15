"""Semantics-preserving TEProgram → TEProgram transforms (each one idea, each testable alone)."""

from .fold_weights import fold_weights
from .horizontal import horizontal
from .two_phase import two_phase
from .vertical import vertical

__all__ = ["fold_weights", "horizontal", "two_phase", "vertical"]
