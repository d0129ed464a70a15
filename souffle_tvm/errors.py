"""The errors users see. Each names what is wrong with their input and what to do about it."""


class SouffleError(Exception):
    """Base class: anything the CLI reports as a clean one-line error (exit code 2)."""


class ModelLoadError(SouffleError):
    """The model file is missing, truncated or not valid ONNX."""


class UnsupportedOperatorError(SouffleError):
    """The model uses an operator (or an operator form) that the importer cannot convert."""


class DynamicShapeError(SouffleError):
    """A model input has a dimension that is not a fixed number.

    ``dynamic``, where the cause is the model's inputs: each input left dynamic, by name, with
    its dims (a number, or the label of a dynamic dim), so a front end can say how to fix them
    in its own terms (the CLI's ``--input-shapes``).
    """

    def __init__(self, message: str, dynamic: dict[str, tuple[int | str, ...]] | None = None):
        super().__init__(message)
        self.dynamic = dynamic or {}


class UnknownInputError(SouffleError):
    """Shapes were given for names that are not inputs of the model (``names``; the model's
    inputs are ``inputs``)."""

    def __init__(self, message: str, names: list[str] | None = None, inputs: list[str] | None = None):
        super().__init__(message)
        self.names, self.inputs = list(names or []), list(inputs or [])


class ToolchainError(SouffleError):
    """A required external tool (nvcc) is missing or failed."""


class TuningError(SouffleError):
    """Tuning cannot run as asked (no GPU, no tracker, a bad tracker address)."""


class MeasureError(SouffleError):
    """No device to measure on where one was asked for (``--measure``, ``--rpc-tracker``)."""


class EmulationError(SouffleError):
    """The kernel uses a construct the emulator does not model (named in the message)."""


class LoweringError(SouffleError):
    """The module cannot be expressed as one TEProgram (e.g. a dynamic, non-tensor value)."""


class ScheduleError(SouffleError):
    """A group's PrimFunc could not be scheduled as one kernel."""


class StitchError(SouffleError):
    """The stages cannot be stitched as given (mismatched block sizes, barriers under guards...)."""


class MiscompileError(SouffleError):
    """TVM would build a kernel that computes something other than its TIR says (a known TVM
    bug, named in the message): refused rather than run."""


class OptionsError(SouffleError, ValueError):
    """A compile option has a value that does not exist, or does not apply to the target."""


class CoresidencyError(SouffleError):
    """A cooperative kernel's grid cannot be co-resident on the GPU: grid.sync() would deadlock."""


class SouffleWarning(UserWarning):
    """Something went wrong and was recovered from: the CLI prints it as one ``note:`` line."""


class CacheWarning(SouffleWarning):
    """A cache entry (ptxas figures, a cubin, a tuning database line) was unreadable; it is
    recomputed or skipped, never trusted."""


class OverBudgetWarning(SouffleWarning):
    """ptxas still found a stitched kernel over budget (spills, or fewer co-resident blocks than
    SMs) when the feedback rounds ran out: the build is kept, slower than planned."""


class CooperativeBuildWarning(UserWarning):
    """A module holds stitched cooperative kernels: it must be built with the TIR pipeline that
    launches them cooperatively (``souffle_tvm.transform.COOPERATIVE_TIR_PIPELINE``)."""
