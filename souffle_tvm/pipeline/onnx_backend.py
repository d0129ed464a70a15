"""ONNX's backend interface (``onnx.backend.base.Backend``) over ``souffle_tvm.compile``.

``SouffleBackend.prepare(model, device="CPU", fusion="tvm")`` compiles a ModelProto for llvm with
the given fusion (``"tvm"`` or ``"souffle"``) and returns a :class:`SouffleBackendRep` whose
``run(inputs)`` runs it on the CPU. This is what ``onnx.backend.test.BackendTest`` drives
(python/onnx_conformance.py, tests/test_onnx_conformance.py). Only the CPU device exists here.

A model the project cannot compile raises the project's own error (``UnsupportedOperatorError``,
``DynamicShapeError``, ``ModelLoadError``) from ``prepare``; :data:`UNSUPPORTED` lists them.
Models are imported with ``fp16_accumulation="float32"`` (float16 contractions and reductions
accumulate in float32, as ONNX's reference does); ``souffle_tvm.compile`` keeps float16.
Outputs TVM computes in another width of the same kind (int32 for a declared int64) are given
back in the declared type.
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np
import onnx
from onnx.backend.base import Backend, BackendRep, Device, DeviceType

from ..errors import DynamicShapeError, ModelLoadError, SouffleError, UnsupportedOperatorError
from ..frontend.importer import import_onnx
from ..frontend.onnx_graph import NP_DTYPES
from ..runtime import runner
from .driver import Compiled, compile as compile_model

#: the errors that mean "this model is outside what souffle-tvm compiles", with a message
UNSUPPORTED = (UnsupportedOperatorError, DynamicShapeError, ModelLoadError)
FUSIONS = ("tvm", "souffle")


class SouffleBackendRep(BackendRep):
    """A compiled model; ``run`` takes the model's inputs (a list in graph order, or a dict)."""

    def __init__(self, compiled: Compiled, declared: list[str | None]):
        self.compiled = compiled
        self._declared = declared     # each output's ONNX element type as a numpy dtype name

    def run(self, inputs, **kwargs) -> tuple[np.ndarray, ...]:  # noqa: ARG002 - the interface's signature
        model = self.compiled.model
        if isinstance(inputs, dict):
            feeds = inputs
        else:
            arrays = [inputs] if isinstance(inputs, np.ndarray) else list(inputs)
            if len(arrays) != len(model.inputs):
                raise SouffleError(f"the model takes {len(model.inputs)} inputs "
                                   f"({', '.join(i.name for i in model.inputs)}), {len(arrays)} given")
            feeds = {info.name: a for info, a in zip(model.inputs, arrays)}
        ordered = runner.check_feeds(model.inputs, feeds)
        outs = runner.run_vm(self.compiled.executable, model.params, ordered)
        if len(outs) != len(model.outputs):
            raise SouffleError(f"the compiled model returned {len(outs)} outputs, the ONNX graph declares "
                               f"{len(model.outputs)}")
        # TVM may compute an index output in another integer width (int32 for int64): the values
        # are the same, so they are given back in the type the graph declares
        typed = [o.astype(d) if d is not None and o.dtype != np.dtype(d) and o.dtype.kind == np.dtype(d).kind else o
                 for o, d in zip(outs, self._declared)]
        names = [n if n.isidentifier() else f"output_{i}" for i, n in enumerate(model.outputs)]
        return namedtuple("Outputs", names, rename=True)(*typed)


class SouffleBackend(Backend):
    """souffle-tvm as an ONNX backend: llvm (CPU) only, ``fusion`` ``"tvm"`` or ``"souffle"``."""

    @classmethod
    def supports_device(cls, device: str) -> bool:
        return Device(device).type == DeviceType.CPU

    fusion = "tvm"

    @classmethod
    def prepare(cls, model: onnx.ModelProto, device: str = "CPU", fusion: str | None = None, level: str = "v2",
                **kwargs) -> SouffleBackendRep:  # noqa: ARG003 - BackendTest passes rtol/atol here too
        fusion = fusion or cls.fusion
        if not cls.supports_device(device):
            raise SouffleError(f"device {device!r}: the souffle-tvm ONNX backend runs on the CPU only")
        if fusion not in FUSIONS:
            raise SouffleError(f"fusion {fusion!r}: one of {', '.join(FUSIONS)}")
        # float16 contractions accumulate in float32, as ONNX's reference (numpy) does
        imported = import_onnx(model, fp16_accumulation="float32")
        compiled = compile_model(imported, target="llvm", fusion=fusion, level=level, nvcc=False)
        declared = [NP_DTYPES.get(o.type.tensor_type.elem_type) for o in model.graph.output]
        return SouffleBackendRep(compiled, declared)

    @classmethod
    def run_model(cls, model: onnx.ModelProto, inputs, device: str = "CPU", **kwargs):
        return cls.prepare(model, device, **kwargs).run(inputs)

    @classmethod
    def run_node(cls, node: onnx.NodeProto, inputs, device: str = "CPU", outputs_info=None, **kwargs):
        raise UnsupportedOperatorError("the souffle-tvm backend compiles whole models: wrap the node in a graph "
                                       "(onnx.helper.make_graph) and use prepare")


prepare = SouffleBackend.prepare
run_model = SouffleBackend.run_model
supports_device = SouffleBackend.supports_device


def backend_for(fusion: str) -> type[SouffleBackend]:
    """The backend class whose ``prepare`` compiles with ``fusion`` (what BackendTest is given)."""
    if fusion not in FUSIONS:
        raise SouffleError(f"fusion {fusion!r}: one of {', '.join(FUSIONS)}")
    return type(f"SouffleBackend_{fusion}", (SouffleBackend,), {"fusion": fusion})


# ---- ONNX's conformance suite (onnx.backend.test.BackendTest) ----------------------------------

#: kinds of test and their BackendTest category
KINDS = {"NodeModel": "node", "RealModel": "real", "SimpleModel": "simple",
         "PyTorchConvertedModel": "pytorch-converted", "PyTorchOperatorModel": "pytorch-operator"}


def conformance_tests(fusion: str) -> dict[str, object]:
    """``{test name: test function}`` of BackendTest for ``fusion`` on the CPU: its node tests (made
    from the cases the onnx package ships) and its model tests (shipped with the package; the
    "real" ones are its local ``light`` models, so nothing is downloaded). Call a function with
    ``None``; it raises on failure (see :func:`classify`)."""
    from onnx.backend.test import BackendTest

    bt = BackendTest(backend_for(fusion), __name__)
    out = {}
    for category, items in bt._filtered_test_items.items():
        if category not in KINDS:
            continue
        for name, item in items.items():
            if name.endswith("_cpu"):
                out[name] = item.func
    return out


def kind_of(category_or_name: str) -> str:
    return KINDS.get(category_or_name, category_or_name)


def classify(err: BaseException | None) -> tuple[str, str]:
    """(outcome, message) of one conformance test: ``pass``; ``unsupported`` (the project's clear
    error for a model it cannot compile); ``wrong`` (outputs differ from ONNX's: values, shape or
    type); ``skip`` (BackendTest skipped it); ``crash`` (anything else: a bug)."""
    import unittest

    if err is None:
        return "pass", ""
    first = (str(err).strip().splitlines() or [""])[0]
    if isinstance(err, UNSUPPORTED):
        return "unsupported", f"{type(err).__name__}: {first}"
    if isinstance(err, unittest.SkipTest):
        return "skip", first
    if isinstance(err, AssertionError) and _from_comparison(err):
        text = " ".join(str(err).split())
        return "wrong", text[:300]
    return "crash", f"{type(err).__name__}: {first[:300]}"


def _from_comparison(err: BaseException) -> bool:
    """Whether the assertion is BackendTest's comparison of outputs (not one inside TVM)."""
    tb = err.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name == "assert_similar_outputs":
            return True
        tb = tb.tb_next
    return False


def run_conformance_test(func) -> tuple[str, str]:
    """Run one BackendTest function; its outcome as :func:`classify` gives it."""
    try:
        func(None)
    except BaseException as err:  # noqa: BLE001 - every outcome is recorded, none escapes
        if isinstance(err, KeyboardInterrupt):
            raise
        return classify(err)
    return classify(None)
