"""Build a model (TVM's module or Souffle's) and report on it, with ptxas' figures where nvcc is."""

from __future__ import annotations

import re
import time

from tvm import relax

from ..build import executable, ptxas
from ..core import progress
from ..core.targets import describe, is_cuda
from ..frontend.importer import ImportedModel
from ..report import assemble
from ..report.schema import Report
from .results import SouffleModule


def _cuda_modules(mod, acc=None) -> list:
    acc = [] if acc is None else acc
    if mod.kind == "cuda":
        acc.append(mod)
    for sub in mod.imports:
        _cuda_modules(sub, acc)
    return acc


def cuda_source(ex: relax.Executable) -> str | None:
    """The CUDA source of every device module of ``ex`` (None on llvm)."""
    mods = _cuda_modules(ex.mod)
    return "\n".join(m.inspect_source() for m in mods) if mods else None


def _ptxas_figures(src: str | None, arch: str, use_nvcc: bool) -> tuple[dict | None, dict]:
    if not use_nvcc:
        return None, {"available": False, "seconds": 0.0, "note": "nvcc disabled"}
    if ptxas.nvcc_path() is None:
        return None, {"available": False, "seconds": 0.0,
                      "note": "nvcc not found on PATH: no register, shared-memory or spill figures"}
    if not src:
        return None, {"available": False, "seconds": 0.0, "note": ""}
    t = time.perf_counter()
    n = len(re.findall(r"__global__[^;{]*\{", src))
    progress.step(f"nvcc -> ptxas resource figures for {n} kernel{'s' if n != 1 else ''} ({arch})")
    figures = ptxas.measure(src, arch)
    return figures, {"available": figures is not None, "seconds": round(time.perf_counter() - t, 3), "note": ""}


def build_and_report(imported: ImportedModel, souffle: SouffleModule | None, target,
                     use_nvcc: bool) -> tuple[executable.BuildResult, Report, str | None]:
    """Build the imported model (or its Souffle module) and report on it, each cooperative
    kernel with its co-resident limit (the driver refuses grids above it at the end)."""
    t0 = time.perf_counter()
    progress.step(f"building with TVM for {describe(target)}")
    if souffle is not None:
        result = executable.build(souffle.mod, target, stats_from=souffle.unscheduled)
        assemble.add_stitched_work(result, souffle.stitched)
    else:
        result = executable.build(imported.mod, target)
    result.seconds = time.perf_counter() - t0
    if not is_cuda(target):
        return result, assemble.cpu_report(imported.name, result), None
    src = cuda_source(result.executable)
    figures, nvcc = _ptxas_figures(src, str(target.attrs["arch"]), use_nvcc)
    report = assemble.cuda_report(imported.name, target, result, figures, nvcc)
    assemble.check_coresidency(report, str(target.attrs["arch"]), raise_=False)
    return result, report, src
