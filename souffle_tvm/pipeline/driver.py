"""``compile``: one model in, an executable and its Report out. The driver reads as the pipeline:
import, the Souffle passes, build, ptxas feedback, report."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import numpy as np
import tvm
from tvm import relax

from ..build import cuda_graph as cuda_graph_build
from ..build import ptxas
from ..build.facts import check_coresidency
from ..core import progress
from ..core.targets import describe, is_cuda, make_target
from ..cost import latency, prior, shipped
from ..cost.timing_cache import TimingCache
from ..cost.hardware import for_arch
from ..errors import LoweringError, OptionsError
from ..frontend.importer import ImportedModel, import_onnx
from ..measure import regret
from ..measure.device import reach
from ..report import assemble, counted, predicted
from ..report.schema import Report
from . import measuring, results
from .building import build
from .feedback import settle
from .options import AUTO, STITCHING_LEVELS, Feedback, Options


@dataclass
class Compiled:
    """A built model: the executable, the imported model (weights, I/O) and its Report."""

    model: ImportedModel
    target: tvm.target.Target
    executable: relax.Executable
    report: Report
    cuda_source: str | None = None
    fused: tvm.IRModule | None = None       # the module built: its PrimFuncs are the kernels
    calls: dict[str, int] = field(default_factory=dict)            # kernel -> launches per inference
    cost_kernels: list[latency.Kernel] = field(default_factory=list)   # as the latency model prices them

    def export_library(self, path: str) -> None:
        """Write the library plus ``<path>.params.npz`` (weights and I/O names beside it)."""
        self.executable.export_library(path)
        np.savez(f"{path}.params.npz", **{f"param_{i:05d}": p for i, p in enumerate(self.model.params)},
                 __inputs__=np.array([f"{i.name}|{'x'.join(map(str, i.shape))}|{i.dtype}" for i in self.model.inputs]),
                 __outputs__=np.array(self.model.outputs), __target__=np.array(describe(self.target)))


def compile(model, target: str | tvm.target.Target = "cuda", fusion: str = "tvm", *, arch: str | None = None,
            small: bool = False, dtype: str = "float32", shapes: dict | None = None,
            nvcc: bool = True, level: str = AUTO, gemm_k_tile: int | None = None,
            partitioner: str | None = None, reduction: str = "deterministic",
            database: str | None = None, bind: dict | None = None, cuda_graph: bool = False,
            gemm_tile: int | None = None, count_traffic: bool = False, onchip: bool = True,
            measure: bool | None = None, rpc_tracker: str | None = None, rpc_key: str | None = None,
            waves: bool = False) -> Compiled:
    """Compile an ONNX file, ModelProto or zoo model name; returns a :class:`Compiled`.

    ``fusion="tvm"`` is TVM's default Relax pipeline (FuseOps + dlight). ``fusion="souffle"``
    is the Souffle pipeline at ``level`` (``pipeline.options``: v0 no transforms ... v3 stitched
    cooperative kernels, whose grids a second build widens to what ptxas' figures let be
    co-resident; v4 + an L2 prefetch of each kernel's next segment). The default, ``auto``, is
    v3 with the time-driven partitioner; on CUDA TVM's own build is made too and, where the
    latency model predicts it faster under a CUDA graph, returned instead, the report's
    ``fallback`` saying so with both figures (never a build predicted slower than TVM's). A model that cannot be
    lowered to one TEProgram falls back to TVM's path and the report's ``fallback`` says why.
    ``gemm_k_tile``, ``gemm_tile``, ``partitioner``, ``reduction``, ``database``, ``onchip``, ``waves``: see :class:`Options`.
    ``bind``: model inputs fixed to values at compile time ({name: value}; ``frontend.binding``).
    ``cuda_graph``: build with TVM's CUDA-graph rewriting (``build.cuda_graph``; CUDA only).
    ``count_traffic``: run the built kernels in the GPU emulator and put the counted traffic
    beside the analytic bytes (``report.counted``; CUDA only, and slow on large models).
    ``measure``: at level auto, time the candidate builds (Souffle's, TVM's, Souffle's budget
    v3) on the device and keep the measured fastest that matches the reference
    (``pipeline.measuring``): None measures where a GPU is reachable (a local one on CUDA, or
    ``rpc_tracker``/``rpc_key``), True asks for it (on llvm too: this CPU), False never.
    Without a measurement, where the choice flips inside the model's leave-one-model-out
    constants, the build of least worst-case regret is kept and the report says so.
    """
    tgt = target if isinstance(target, tvm.target.Target) else make_target(target, arch)
    options = Options(fusion, level, partitioner, reduction, gemm_k_tile, database, nvcc, gemm_tile, onchip,
                      waves).check(tgt)
    if (measure or rpc_tracker or rpc_key) and not (level == AUTO and fusion == "souffle"):
        raise OptionsError("--measure and --rpc-tracker choose among the candidates of --fusion souffle --level auto "
                           f"(given --fusion {fusion} --level {level})")
    device = reach(tgt, measure, rpc_tracker, rpc_key) if level == AUTO and fusion == "souffle" else None
    with prior.using(_device_prior(device)):
        return _compile(model, tgt, fusion, options, level == AUTO, small, dtype, shapes, nvcc, database, bind,
                        cuda_graph, count_traffic, device)


def _compile(model, tgt: tvm.target.Target, fusion: str, options: Options, auto: bool, small: bool, dtype: str,
             shapes: dict | None, nvcc: bool, database: str | None, bind: dict | None, cuda_graph: bool,
             count_traffic: bool, device) -> Compiled:
    """``compile`` with its options checked and the device (if any) reached, under its prior."""
    level = options.level
    if not isinstance(model, ImportedModel):
        progress.step(f"importing {model if isinstance(model, str) else 'the ONNX model'}")
    imported = model if isinstance(model, ImportedModel) else import_onnx(model, shapes, small=small, dtype=dtype,
                                                                          bind=bind)
    source = imported
    t0 = time.perf_counter()
    souffle, fallback = None, None
    if fusion == "souffle":
        progress.step(f"souffle pipeline {level}: lower to TE, transform, partition"
                      + (", stitch" if level in STITCHING_LEVELS else ""))
        try:
            first = Feedback(estimated_grids=nvcc and ptxas.nvcc_path() is not None)
            souffle = results.run(imported.mod, tgt, imported.params, options, first)
        except LoweringError as err:
            fallback = str(err)   # documented: the whole model then builds through TVM's path
    with cuda_graph_build.enabled(cuda_graph and is_cuda(tgt)):
        if souffle is not None and is_cuda(tgt):
            built = settle(imported, souffle, tgt, nvcc)
            souffle, result, facts, src, nvcc_seconds = (built.souffle, built.result, built.facts, built.source,
                                                         built.nvcc_seconds)
        else:
            result, facts, src = build(imported, souffle, tgt, nvcc)
            nvcc_seconds = facts.nvcc.get("seconds", 0.0)
    graphs = None
    if cuda_graph and is_cuda(tgt):
        summary = cuda_graph_build.summary(result.executable, set(result.calls))
        for k in facts.kernels:
            k.launches_outside_graph = summary["outside_by_function"].get(k.primfunc, 0)
        graphs = {k: v for k, v in summary.items() if k != "outside_by_function"}
    if is_cuda(tgt) and facts.nvcc.get("available"):
        check_coresidency(facts)   # never launch a grid that cannot be co-resident
    if souffle is not None:
        imported = dataclasses.replace(imported, mod=souffle.mod, params=souffle.params)
    result.seconds = time.perf_counter() - t0 - nvcc_seconds     # nvcc is reported on its own
    facts.seconds = result.seconds
    report = assemble.render(facts)    # the report, once, from what was built
    report.cuda_graph = graphs
    report.nvcc["seconds"] = round(nvcc_seconds, 3)
    report.fusion = fusion
    if souffle is None:
        assemble.add_forms(report, result.fused)
    if fusion == "souffle":
        report.fallback = fallback
        if souffle is not None:
            assemble.add_souffle_decisions(report, level, souffle.partition, souffle.program, souffle.subprograms,
                                           souffle.stitched, souffle.schedule_notes, souffle.rule_failures)
            assemble.add_reductions(report, souffle.two_phase)
            assemble.add_forms(report, souffle.mod, souffle.unstitched, souffle.stitched)
            if database is not None:
                report.database = database
                assemble.add_schedule_sources(report, souffle.mod, souffle.unstitched, souffle.stitched)
    if count_traffic and is_cuda(tgt):
        stitched = souffle.stitched if souffle is not None else []
        counted.count(report, souffle.mod if souffle is not None else result.fused, tgt, source,
                      imported.params, result.footprints, stitched)
    kernels = facts.cost_kernels() if is_cuda(tgt) else []
    predicted.add_latency(report, kernels, prior.current().constants)
    compiled = Compiled(imported, tgt, result.executable, report, src, result.fused, dict(result.calls), kernels)
    if auto and souffle is not None and (device is not None or (is_cuda(tgt) and report.latency)):
        progress.step("TVM's own build, to compare" + (" on the device" if device else " predicted times"))
        try:
            # on a device, TVM's kernels as users run them: under a CUDA graph
            theirs = compile(source, tgt, "tvm", nvcc=nvcc, cuda_graph=cuda_graph or (is_cuda(tgt) and device is not None),
                             count_traffic=count_traffic)
        except Exception as err:  # noqa: BLE001 - only a comparison: TVM's failure must not fail ours
            # (TVM 0.27's dlight schedules of grouped convolutions fail its own lowering; issue 33)
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            compiled.report.latency = (compiled.report.latency or {}) | {"tvm_build_failed":
                                                                         f"{type(err).__name__}: {first[:200]}"}
            theirs = None
        if device is not None:
            budget = compile(source, tgt, "souffle", nvcc=nvcc, level="v3", cuda_graph=cuda_graph, measure=False)
            builds = [("souffle", compiled)] + ([("tvm", theirs)] if theirs is not None else [])
            compiled = measuring.choose(device, builds + [("souffle v3 budget", budget)])
        elif theirs is not None:
            compiled = _faster_of(compiled, theirs)
    progress.clear()     # the caller prints next: no half line of progress in front of it
    return compiled


def _device_prior(device) -> prior.Prior | None:
    """The device's own constants (``souffle-tvm fit``) and kernel times, from its timing cache."""
    if device is None:
        return None
    cache = TimingCache.for_device(device.info)
    fitted = cache.fitted()
    return prior.Prior(fitted or latency.FITTED, cache.measured_times(),
                       f"fitted on {device.info['name']}" if fitted else "fitted")


def _faster_of(souffle: Compiled, tvm_build: Compiled) -> Compiled:
    """Souffle's build, unless the latency model predicts TVM's own faster under a CUDA graph
    (an estimate); the report that is returned carries both figures and both compile times.
    Where the leave-one-model-out constants disagree on which is faster, the build of least
    worst-case regret over them is kept (``measure.regret``), and the report says so."""
    ours = souffle.report.latency["graph_ms"]
    theirs = (tvm_build.report.latency or {}).get("graph_ms")     # none where TVM's build launches nothing
    waited = souffle.report.compile_seconds + tvm_build.report.compile_seconds
    choice = None
    if theirs is not None:
        gpu = for_arch(souffle.report.arch or "sm_90")
        kernels = {"souffle": souffle.cost_kernels, "tvm": tvm_build.cost_kernels}
        choice = regret.choose(lambda c: {n: latency.predict(gpu, c, ks, graphs=True).seconds
                                          for n, ks in kernels.items()},
                               prior.current().constants, shipped.leave_one_model_out())
        souffle.report.latency["choice"] = choice.as_dict()
    # TVM's build with kernels the model cannot price is no comparison: ours is kept
    if choice.name == "souffle" if choice is not None else tvm_build.report.launches > 0:
        souffle.report.latency["tvm_graph_ms"] = theirs
        souffle.report.compile_seconds = round(waited, 3)
        return souffle
    report = tvm_build.report
    report.fusion, report.compile_seconds = "souffle", round(waited, 3)
    if theirs is None:      # a constant model: TVM folds it whole at compile time
        report.fallback = (f"TVM's own build launches no kernel (the model folds to constants); "
                           f"it is used ({ours:.3f} ms predicted for Souffle's v3)")
        return tvm_build
    report.latency["souffle_graph_ms"] = ours
    report.latency["choice"] = choice.as_dict()
    if theirs < ours:
        said = f"the latency model predicts TVM's own kernels faster under a CUDA graph: {theirs:.3f} ms against "
    else:
        said = f"the fitted constants predict TVM's own kernels at {theirs:.3f} ms under a CUDA graph, against "
    rule = ("" if not choice.uncertain else
            f"; the constant sets disagree, and TVM's build has the least worst-case regret over them "
            f"(the choice flips at {'; '.join(choice.flips) or 'a combination of constants'})")
    report.fallback = f"{said}{ours:.3f} ms for Souffle's v3 (estimates){rule}; TVM's build is used"
    return tvm_build
