"""The errors users see. Each names what is wrong with their input and what to do about it."""


class SouffleError(Exception):
    """Base class: anything the CLI reports as a clean one-line error (exit code 2)."""


class ModelLoadError(SouffleError):
    """The model file is missing, truncated or not valid ONNX."""


class UnsupportedOperatorError(SouffleError):
    """The model uses an operator (or an operator form) that the importer cannot convert."""


class DynamicShapeError(SouffleError):
    """A model input has a dimension that is not a fixed number."""


class ToolchainError(SouffleError):
    """A required external tool (nvcc) is missing or failed."""
