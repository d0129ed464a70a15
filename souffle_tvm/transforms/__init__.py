"""Semantics-preserving TEProgram → TEProgram transforms (each one idea, each testable alone)."""

from .horizontal import horizontal
from .vertical import vertical

__all__ = ["horizontal", "vertical"]
