"""Build a model (TVM's module or Souffle's) and gather its facts, with ptxas' figures where nvcc is."""

from __future__ import annotations

import re
import time

from tvm import relax

from ..build import executable, ptxas
from ..build.facts import BuildFacts, add_stitched_work, cpu_facts, cuda_facts
from ..core import progress
from ..core.targets import describe, is_cuda
from ..frontend.importer import ImportedModel
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


def build(imported: ImportedModel, souffle: SouffleModule | None, target,
          use_nvcc: bool) -> tuple[executable.BuildResult, BuildFacts, str | None]:
    """Build the imported model (or its Souffle module): (the build, its facts, its CUDA
    source), each cooperative kernel with its co-resident limit (the driver refuses grids
    above it at the end) and each stitched kernel with its stages' plan."""
    t0 = time.perf_counter()
    progress.step(f"building with TVM for {describe(target)}")
    if souffle is not None:
        result = executable.build(souffle.mod, target, stats_from=souffle.unscheduled)
        add_stitched_work(result, souffle.stitched)
    else:
        result = executable.build(imported.mod, target)
    result.seconds = time.perf_counter() - t0
    stitched, unstitched = (souffle.stitched, souffle.unstitched) if souffle is not None else ((), None)
    if not is_cuda(target):
        return result, cpu_facts(imported.name, result, stitched, unstitched), None
    src = cuda_source(result.executable)
    figures, nvcc = _ptxas_figures(src, str(target.attrs["arch"]), use_nvcc)
    return result, cuda_facts(imported.name, target, result, figures, nvcc, stitched, unstitched), src
