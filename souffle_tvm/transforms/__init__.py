"""Semantics-preserving TEProgram → TEProgram transforms (each one idea, each testable alone)."""

from .vertical import vertical

__all__ = ["vertical"]
