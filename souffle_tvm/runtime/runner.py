"""Run a compiled model on the CPU and compare it with a reference runtime.

The reference is onnxruntime (a test-only dependency); where it is not installed,
``onnx.reference.ReferenceEvaluator`` (slow, and seen wrong on some real models).
"""

from __future__ import annotations

import importlib.util
import math
import os
import re

import numpy as np
import tvm
from tvm import relax

from ..errors import SouffleError
from ..frontend.importer import TensorInfo, native_stderr_held
from .numerics import Comparison, compare, default_tolerance, random_inputs, reference_outputs

__all__ = ["Comparison", "compare", "default_tolerance", "random_inputs", "reference_outputs",
           "check_feeds", "check_given", "check_memory", "checked_reference", "run_vm"]


def available_memory() -> int:
    """Bytes of memory this process could still allocate (Linux's MemAvailable)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"


def check_memory(infos: list[TensorInfo], available: int | None = None) -> None:
    """Refuse, before anything is allocated, inputs that cannot fit in memory (a huge
    --input-shapes): the seeded inputs are drawn in float64, then cast."""
    sizes = {i.name: math.prod(i.shape) * np.dtype(i.dtype).itemsize for i in infos}
    drawn = max((math.prod(i.shape) * 8 for i in infos), default=0)     # the float64 draw of the largest
    need = sum(sizes.values()) + drawn
    have = available_memory() if available is None else available
    if need > have:
        biggest = max(infos, key=lambda i: sizes[i.name])
        raise SouffleError(f"inputs of these shapes need {_human(need)} ({biggest.name!r} "
                           f"{'x'.join(map(str, biggest.shape))} {biggest.dtype} alone {_human(sizes[biggest.name])}); "
                           f"this machine has {_human(have)} available: give smaller --input-shapes")


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


def check_given(types: dict[str, str], feeds: dict[str, np.ndarray], source: str = "the given inputs") -> None:
    """Refuse given arrays that do not fit the model's inputs (``types``: name -> dtype) by
    name or dtype, as onnxruntime would, before anything is compiled; ``source`` names where
    they came from (``--inputs FILE``). Unlike :func:`check_feeds`, no dtype is cast."""
    extra = [k for k in feeds if k not in types]
    if extra:
        one = len(extra) == 1
        raise SouffleError(f"{source}: {', '.join(map(repr, extra))} {'is not an input' if one else 'are not inputs'} "
                           f"of the model (its inputs: {', '.join(types) or 'none'})")
    missing = [k for k in types if k not in feeds]
    if missing:
        raise SouffleError(f"{source}: no array for input{'s' if len(missing) > 1 else ''} "
                           f"{', '.join(map(repr, missing))} (it holds {', '.join(feeds) or 'none'})")
    for name, dtype in types.items():
        given = np.asarray(feeds[name]).dtype
        if dtype != "?" and given != np.dtype(dtype):
            raise SouffleError(f"{source}: input {name!r} is {given}, the model expects {dtype} "
                               f"(save it as {dtype})")


def checked_reference(model, feeds: dict[str, np.ndarray]) -> tuple[str, list[np.ndarray]]:
    """:func:`reference_outputs`, or a SouffleError saying that the reference runtime could not
    run the model (an opset or operator form it lacks); its own log lines are kept off stderr."""
    try:
        with native_stderr_held():
            return reference_outputs(model, feeds)
    except Exception as err:  # noqa: BLE001 - onnxruntime's errors share no base class but Exception
        text = (str(err).strip().splitlines() or [type(err).__name__])[0]
        text = re.sub(r"^\[ONNXRuntimeError\] : \d+ : ", "", text).rstrip(".")
        runtime = "onnxruntime" if importlib.util.find_spec("onnxruntime") else "the ONNX reference evaluator"
        raise SouffleError(f"the reference runtime ({runtime}) could not run the model: {text[:300]}") from None


def run_vm(executable, params: list[np.ndarray], inputs: list[np.ndarray], device=None) -> list[np.ndarray]:
    """Run ``main`` through Relax's VM (on the CPU unless ``device``); returns numpy outputs."""
    dev = device or tvm.cpu()
    vm = relax.VirtualMachine(executable, dev)
    args = [tvm.runtime.tensor(a, dev) for a in inputs] + [tvm.runtime.tensor(p, dev) for p in params]
    out = vm["main"](*args)
    return flatten(out)


def cuda_device():
    """The first CUDA GPU, or a SouffleError saying why there is none to run on."""
    try:
        dev = tvm.cuda(0)
        present = dev.exist
    except Exception:  # noqa: BLE001 - a TVM without its CUDA runtime raises here
        present = False
    if not present:
        raise SouffleError("no CUDA GPU (or no TVM CUDA runtime) on this machine: `run --target cuda` needs "
                           "one; `compile --target cuda` builds without a GPU")
    return dev


def median_ms(executable, params: list[np.ndarray], inputs: list[np.ndarray], runs: int, device=None) -> float:
    """Median wall time of ``runs`` calls of ``main`` after one warm-up, synchronised with the
    device (TVM's time evaluator: CUDA events' equivalent through stream synchronisation)."""
    dev = device or tvm.cpu()
    vm = relax.VirtualMachine(executable, dev)
    args = [tvm.runtime.tensor(a, dev) for a in inputs] + [tvm.runtime.tensor(p, dev) for p in params]
    vm.set_input("main", *args)
    timer = vm.time_evaluator("invoke_stateful", dev, number=1, repeat=max(runs, 1), min_repeat_ms=0)
    return float(np.median(timer("main").results)) * 1e3


def flatten(out) -> list[np.ndarray]:
    """A VM result (a tensor, a shape, or nested tuples of them) as a flat list of numpy arrays."""
    if hasattr(out, "numpy"):
        return [out.numpy()]
    if isinstance(out, tvm.runtime.ShapeTuple):
        # a static shape the model returns (ONNX ``Shape`` of an input): an int64 tensor
        return [np.array(list(out), dtype=np.int64)]
    return [a for item in out for a in flatten(item)]


