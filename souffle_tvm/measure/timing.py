"""Timing a build on a device: a whole inference (warm-up, then the median of repeated runs and
their interquartile range), and each kernel on its own.

Both run from libraries exported here and loaded on the device, as MetaSchedule's runners do,
so a remote device needs only TVM's runtime. A whole inference goes through the Relax VM's
``invoke_stateful`` under TVM's time evaluator (which synchronises the device around each
run). A kernel is timed by the same evaluator on the kernels' library alone, with its buffers
zero-filled (zeros keep every gather index in bounds; a dense kernel's time does not depend on
its values): its time per launch.
"""

from __future__ import annotations

import itertools
import os
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tvm
from tvm import relax, tirx

from ..runtime.runner import flatten
from .device import Device

WARMUP = 3
REPEAT = 15
KERNEL_REPEAT = 7


@dataclass(frozen=True)
class Timing:
    """Median and interquartile range of ``runs`` timed runs, in seconds."""
    seconds: float
    spread: float
    runs: int

    @classmethod
    def of(cls, samples: list[float]) -> "Timing":
        xs = sorted(samples)
        if len(xs) < 4:
            return cls(statistics.median(xs), xs[-1] - xs[0], len(xs))
        q = statistics.quantiles(xs, n=4)
        return cls(statistics.median(xs), q[2] - q[0], len(xs))


def _load(device: Device, module, stem: str):
    """``module`` exported here and loaded on the device, under a name of its own: a loader keeps
    a library by its path (dlopen), so two candidates must never share one."""
    with tempfile.TemporaryDirectory(prefix="souffle-measure-") as tmp:
        path = Path(tmp) / f"{stem}-{next(_names)}-{os.getpid()}.so"
        module.export_library(str(path))
        return device.load(path)


_names = itertools.count()


def inference(device: Device, executable: relax.Executable, args: list[np.ndarray],
              repeat: int = REPEAT) -> tuple[list[np.ndarray], Timing]:
    """Run ``main`` once on the device (its outputs, for the numeric check), then time it:
    ``WARMUP`` runs dropped, ``repeat`` kept."""
    mod = _load(device, executable.mod, "candidate")
    vm = relax.VirtualMachine(mod, device.dev)
    tensors = [tvm.runtime.tensor(a, device.dev) for a in args]
    vm.set_input("main", *tensors)
    vm.invoke_stateful("main")
    outputs = flatten(vm.get_outputs("main"))     # copied back one by one: a remote tuple is not iterable
    timer = vm.time_evaluator("invoke_stateful", device.dev, number=1, repeat=WARMUP + repeat, min_repeat_ms=0)
    return outputs, Timing.of(list(timer("main").results)[WARMUP:])


def _static_args(func: tirx.PrimFunc) -> list[tuple[list[int], str]] | None:
    """Each parameter's (shape, dtype), or None where one is not a buffer of static shape."""
    out = []
    for p in func.params:
        ty = p.ty
        shape = getattr(ty, "shape", None)
        if shape is None or not all(isinstance(d, tirx.IntImm) for d in shape):
            return None
        out.append(([int(d) for d in shape], str(ty.dtype)))
    return out


def kernels(device: Device, executable: relax.Executable, funcs: dict[str, tirx.PrimFunc],
            repeat: int = KERNEL_REPEAT) -> dict[str, Timing]:
    """Per kernel in ``funcs`` (name -> its PrimFunc in the built module), one launch's time on
    the device; kernels with a parameter that is not a static buffer are left out."""
    libs = [m for m in executable.mod.imports if m.kind != "relax.VMExecutable"]
    if not libs or not funcs:
        return {}
    lib = _load(device, libs[0], "kernels")
    out = {}
    for name, func in funcs.items():
        shapes = _static_args(func)
        if shapes is None:
            continue
        args = [tvm.runtime.tensor(np.zeros(shape, dtype), device.dev) for shape, dtype in shapes]
        timer = lib.time_evaluator(name, device.dev, number=1, repeat=1 + repeat, min_repeat_ms=0)
        out[name] = Timing.of(list(timer(*args).results)[1:])
    return out
