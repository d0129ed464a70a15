"""``souffle_tvm.compile``: the one-call API. ONNX/zoo model in; executable and Report out."""

from __future__ import annotations

import dataclasses
import re
import time
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax, tirx

from ..build import executable as build_tvm, ptxas as resources
from ..core import hardware, progress, tir_stats
from . import stitching as pipeline
from ..codegen.database import open_database, schedule_source
from ..errors import LoweringError, SouffleError, StitchError
from ..frontend.importer import ImportedModel, import_onnx
from ..report.schema import KernelReport, Report
from ..core.targets import describe, is_cuda, make_target

FUSIONS = ("tvm", "souffle")


@dataclass
class Compiled:
    """A built model: the executable, the imported model (weights, I/O) and its Report."""

    model: ImportedModel
    target: tvm.target.Target
    executable: relax.Executable
    report: Report
    cuda_source: str | None = None

    def export_library(self, path: str) -> None:
        """Write the library plus ``<path>.params.npz`` (weights and I/O names beside it)."""
        self.executable.export_library(path)
        np.savez(f"{path}.params.npz", **{f"param_{i:05d}": p for i, p in enumerate(self.model.params)},
                 __inputs__=np.array([f"{i.name}|{'x'.join(map(str, i.shape))}|{i.dtype}" for i in self.model.inputs]),
                 __outputs__=np.array(self.model.outputs), __target__=np.array(describe(self.target)))


def _cuda_modules(mod, acc=None) -> list:
    acc = [] if acc is None else acc
    if mod.kind == "cuda":
        acc.append(mod)
    for sub in mod.imports:
        _cuda_modules(sub, acc)
    return acc


def cuda_source(executable: relax.Executable) -> str | None:
    mods = _cuda_modules(executable.mod)
    return "\n".join(m.inspect_source() for m in mods) if mods else None


def _kernel_flops(kernels: list[build_tvm.DeviceKernel], flops: dict[str, int]) -> list[int]:
    """Split a PrimFunc's block flops over its kernels by which kernel stores each block's buffer."""
    if len(kernels) == 1:
        return [sum(flops.values())]
    out = [0] * len(kernels)
    for buf, f in flops.items():
        owner = next((i for i, k in enumerate(kernels) if buf in k.stored), 0)
        out[owner] += f
    return out


def _kernel_bytes(kernel: build_tvm.DeviceKernel, footprint: dict[str, int]) -> int:
    """Compulsory traffic of one launch: each global buffer's accessed footprint (whole size
    where the unscheduled TIR has no region for it, e.g. scheduler-made temporaries)."""
    return sum(min(footprint.get(name, size), size) for name, size in kernel.global_buffers.items())


def _cuda_report(name: str, target, result: build_tvm.BuildResult, src: str | None, use_nvcc: bool) -> Report:
    arch = str(target.attrs["arch"])
    nvcc_note, res, t_nvcc = "", None, 0.0
    if not use_nvcc:
        nvcc_note = "nvcc disabled"
    elif resources.nvcc_path() is None:
        nvcc_note = "nvcc not found on PATH: no register, shared-memory or spill figures"
    elif src:
        t = time.perf_counter()
        n = len(re.findall(r"__global__[^;{]*\{", src))
        progress.step(f"nvcc -> ptxas resource figures for {n} kernel{'s' if n != 1 else ''} ({arch})")
        res = resources.measure(src, arch)
        t_nvcc = time.perf_counter() - t
    by_func: dict[str, list[build_tvm.DeviceKernel]] = {}
    for k in result.kernels:
        by_func.setdefault(k.primfunc, []).append(k)
    kernels = []
    for pf, calls in result.calls.items():
        ks = by_func.get(pf, [])
        for k, fl in zip(ks, _kernel_flops(ks, result.flops.get(pf, {}))):
            r = res.get(k.name) if res else None
            kernels.append(KernelReport(
                k.name, pf, k.grid, k.block, r.registers if r else None,
                (r.shared_bytes if r else 0) + k.dyn_shared_bytes if (r or not res) else None,
                r.spill_bytes if r else None, calls, _kernel_bytes(k, result.footprints.get(pf, {})), fl,
                cooperative=k.cooperative))
    distinct = len({k.name for k in result.kernels if k.primfunc in result.calls})
    return _totals(name, describe(target).split()[0], arch, kernels, distinct, result.seconds,
                   {"available": res is not None, "seconds": round(t_nvcc, 3), "note": nvcc_note})


def _cpu_report(name: str, result: build_tvm.BuildResult) -> Report:
    funcs = {gv.name_hint: f for gv, f in result.fused.functions.items() if isinstance(f, tirx.PrimFunc)}
    kernels = [KernelReport(pf, pf, None, None, None, None, None, calls,
                            sum(result.footprints.get(pf, {}).values()) or tir_stats.primfunc_param_bytes(funcs[pf]),
                            sum(result.flops.get(pf, {}).values()))
               for pf, calls in result.calls.items()]
    return _totals(name, "llvm", None, kernels, len(kernels), result.seconds,
                   {"available": False, "seconds": 0.0, "note": "CPU target"})


def _totals(name, target, arch, kernels, distinct, seconds, nvcc) -> Report:
    return Report(model=name, target=target, arch=arch, fusion="tvm",
                  launches=sum(k.launches for k in kernels), distinct_kernels=distinct,
                  compile_seconds=round(seconds, 3),
                  bytes=sum(k.launches * k.bytes for k in kernels),
                  flops=sum(k.launches * k.flops for k in kernels), nvcc=nvcc, kernels=kernels)


def _stitched_stats(result: build_tvm.BuildResult, souffle) -> None:
    """A stitched kernel does its stages' work and moves their traffic (intermediates included:
    without two-phase reductions they still pass through global memory)."""
    for k in souffle.stitched:
        if k.refused:
            continue
        # Once per call: a function called many times (an LSTM's GEMV) counts each time, and a
        # function lowered to several launch regions ("<function>.<i>") counts once.
        calls = [st.split(".")[0] for st in k.stages if st.split(".")[1:] in ([], ["0"])]
        result.flops[k.function] = {f"{i}:{st}:{b}": f for i, st in enumerate(calls)
                                    for b, f in result.flops.get(st, {}).items()}
        result.footprints[k.function] = {}
        for st in calls:
            for b, v in result.footprints.get(st, {}).items():
                result.footprints[k.function][b] = result.footprints[k.function].get(b, 0) + v


def _check_coresidency(report: Report, arch: str, raise_: bool = True) -> None:
    """A cooperative grid must fit on the GPU at once, or grid.sync() deadlocks: refuse the build
    (or, with ``raise_=False``, only fill in each kernel's co-resident limit)."""
    from ..core.hardware import for_arch, occupancy

    gpu = for_arch(arch)
    for k in report.kernels:
        if not k.cooperative or k.registers is None:
            continue
        occ = occupancy(gpu, k.block[0] * k.block[1] * k.block[2], k.registers, k.shared_bytes or 0)
        k.max_coresident = occ.max_coresident(gpu)
        blocks = k.grid[0] * k.grid[1] * k.grid[2]
        if raise_ and blocks > k.max_coresident:
            raise StitchError(f"{k.name}: a grid of {blocks} blocks cannot be co-resident on {gpu.name} "
                              f"(at most {k.max_coresident}: {occ.blocks_per_sm}/SM, limited by {occ.limited_by})")


def _build(imported: ImportedModel, souffle, tgt, nvcc: bool):
    """Build the imported model (or its Souffle module) and report on it, each cooperative
    kernel with its co-resident limit (``compile`` refuses grids above it at the end)."""
    t0 = time.perf_counter()
    progress.step(f"building with TVM for {describe(tgt)}")
    if souffle is not None:
        result = build_tvm.build(souffle.mod, tgt, stats_from=souffle.unscheduled)
        _stitched_stats(result, souffle)
    else:
        result = build_tvm.build(imported.mod, tgt)
    result.seconds = time.perf_counter() - t0
    if is_cuda(tgt):
        src = cuda_source(result.executable)
        report = _cuda_report(imported.name, tgt, result, src, nvcc)
        _check_coresidency(report, str(tgt.attrs["arch"]), raise_=False)
    else:
        src, report = None, _cpu_report(imported.name, result)
    return result, report, src


def group_edges(prog, groups: list) -> list[list[int]]:
    """The group DAG as ``[producer index, consumer index]`` pairs (indices into ``groups``):
    a consumer group reads a tensor some member (or opaque output) of the producer writes."""
    owner = {}
    for i, g in enumerate(groups):
        for t in (g.opaque.outputs if g.opaque is not None else g.members):
            owner[t.op] = i
    edges = set()
    for j, g in enumerate(groups):
        reads = ([x.op for x in g.opaque.inputs.values()] if g.opaque is not None
                 else [x.op for m in g.members for x in m.op.input_tensors])
        edges.update((owner[op], j) for op in reads if op in owner and owner[op] != j)
    return [list(e) for e in sorted(edges)]


MAX_FEEDBACK_ROUNDS = 6   # each round halves the kernels that did not fit


def _over_budget(report: Report, souffle, arch: str) -> dict[str, str]:
    """{stitched kernel function: what ptxas found} for kernels that spill or leave no block of
    the kernel co-resident on an SM: the partitioner's estimate was wrong about them."""
    from ..core.hardware import for_arch

    gpu = for_arch(arch)
    stitched = {k.function for k in souffle.stitched if not k.refused and len(k.stages) > 1}
    out = {}
    for k in report.kernels:
        if k.primfunc not in stitched or k.registers is None:
            continue
        if k.spill_bytes:
            out[k.primfunc] = f"{k.spill_bytes} B of register spills ({k.registers} registers)"
        elif (k.max_coresident or 0) < gpu.sms:
            out[k.primfunc] = (f"{k.registers} registers and {k.shared_bytes} B shared memory leave "
                               f"{k.max_coresident} blocks co-resident, fewer than the {gpu.sms} SMs")
    return out


def _spills(report: Report) -> int:
    return sum(k.spill_bytes or 0 for k in report.kernels if k.cooperative)


def _coresident(report: Report, arch: str) -> bool:
    try:
        _check_coresidency(report, arch)
        return True
    except StitchError:
        return False


def _coresident_grids(report: Report, souffle) -> dict[str, int]:
    """{stitched kernel function: blocks} where the grid launched (from the static estimate)
    differs from what ptxas' figures let be co-resident and the stages can use: fewer (needed,
    or grid.sync() could deadlock) or more (more parallelism)."""
    stitched = {k.function: k for k in souffle.stitched if not k.refused}
    out = {}
    for k in report.kernels:
        sk = stitched.get(k.primfunc)
        if sk is not None and k.cooperative and k.max_coresident:
            want = min(k.max_coresident, sk.max_blocks)
            if want != sk.grid:
                out[k.primfunc] = want
    return out


def _schedule_sources(report: Report, souffle) -> None:
    """Per kernel: did its schedule come from the tuning database or from the default rules
    (a stitched kernel counts its stages)."""
    funcs = {gv.name_hint: f for gv, f in souffle.mod.functions.items() if isinstance(f, tirx.PrimFunc)}
    stages = {gv.name_hint: f for gv, f in (souffle.unstitched or souffle.mod).functions.items()
              if isinstance(f, tirx.PrimFunc)}
    for kr in report.kernels:
        if kr.stages:
            # a group lowered to several launches gives stages "<function>.<i>"
            found = [schedule_source(f) for f in (stages.get(s, stages.get(s.rsplit(".", 1)[0])) for s in kr.stages)
                     if f is not None]
            n = sum(1 for src, _ in found if src == "database")
            kr.schedule = ("database" if found and n == len(found) else "default" if n == 0
                           else f"mixed: {n} of {len(found)} stages from the database")
            notes = sorted({note for _, note in found if note})
            kr.schedule_note = "; ".join(notes) or None
        elif kr.primfunc in funcs:
            kr.schedule, kr.schedule_note = schedule_source(funcs[kr.primfunc])


def compile(model, target: str | tvm.target.Target = "cuda", fusion: str = "tvm", *, arch: str | None = None,
            small: bool = False, dtype: str = "float32", shapes: dict | None = None,
            nvcc: bool = True, level: str = "v2", gemm_k_tile: int | None = None,
            partitioner: str = "budget", reduction: str = "deterministic",
            database: str | None = None) -> Compiled:
    """Compile an ONNX file, ModelProto or zoo model name; returns a :class:`Compiled`.

    ``fusion="tvm"`` is TVM's default Relax pipeline (FuseOps + dlight). ``fusion="souffle"``
    is the Souffle pipeline at ``level`` (v0: no transforms; v1: + horizontal; v2: + vertical,
    one kernel per anchor group; v3: + subprograms stitched into cooperative kernels, whose
    grids a second build widens to what ptxas' figures let be co-resident; v4: + each stitched
    kernel prefetches its next segment's inputs into L2). A model that cannot be
    lowered to one TEProgram falls back to TVM's path and the report's ``fallback`` says why.
    ``gemm_k_tile`` (v3, CUDA) sets the K tile of stitched GEMM stages (default 16); tiles over
    48 KB go to dynamic shared memory. ``partitioner`` (v3): "budget" (resource-aware, the
    default) or "blocks" (a subprogram per attention/FFN block). ``reduction`` (v3, CUDA):
    "deterministic" two-phase reductions (partial buffer + combine) or "atomic" (fp32 sums with
    atomicAdd). ``database`` (souffle fusion): a directory written by ``souffle-tvm tune``; its
    tuned schedules replace the default rules for the groups it matches (v3: only those whose
    thread count is the stitched kernel's), and the report says per kernel which was used.
    """
    if fusion not in FUSIONS:
        raise SouffleError(f"unknown fusion {fusion!r}: choose 'tvm' or 'souffle'")
    tgt = target if isinstance(target, tvm.target.Target) else make_target(target, arch)
    if not isinstance(model, ImportedModel):
        progress.step(f"importing {model if isinstance(model, str) else 'the ONNX model'}")
    imported = model if isinstance(model, ImportedModel) else import_onnx(model, shapes, small=small, dtype=dtype)
    if database is not None and fusion != "souffle":
        raise SouffleError("--database applies tuned Souffle stages: use it with --fusion souffle")
    tuned = open_database(database) if database is not None else None
    t0 = time.perf_counter()
    souffle, fallback = None, None
    if fusion == "souffle":
        progress.step(f"souffle pipeline {level}: lower to TE, transform, partition"
                      + (", stitch" if level in pipeline.STITCHING_LEVELS else ""))
        try:
            souffle = pipeline.run(imported.mod, tgt, imported.params, level=level, gemm_k_tile=gemm_k_tile,
                                   partitioner=partitioner, reduction=reduction, database=tuned,
                                   estimated_grids=nvcc and resources.nvcc_path() is not None)
        except LoweringError as err:
            fallback = str(err)   # documented: the whole model then builds through TVM's path
    result, report, src = _build(imported, souffle, tgt, nvcc)
    nvcc_seconds = report.nvcc.get("seconds", 0.0)
    for round_ in range(MAX_FEEDBACK_ROUNDS if souffle is not None and souffle.partitioner == "budget" else 0):
        # Schedule feedback: ptxas overrules the partitioner's estimate; split what did not fit.
        over = _over_budget(report, souffle, str(tgt.attrs["arch"])) if report.nvcc.get("available") else {}
        if not over:
            break
        prefetching = {k.function for k in souffle.stitched if k.function in over and k.prefetched_bytes}
        if prefetching:
            # V4's prefetch loops are what the kernel gives up first: V3's form of it may fit
            progress.step(f"ptxas feedback: dropping the L2 prefetch of {len(prefetching)} kernel(s) that did "
                          "not fit with it", round_ + 1, MAX_FEEDBACK_ROUNDS)
            souffle = pipeline.drop_prefetch(souffle, tgt, prefetching)
        else:
            progress.step(f"ptxas feedback: splitting {len(over)} kernel(s) that did not fit", round_ + 1,
                          MAX_FEEDBACK_ROUNDS)
            souffle = pipeline.split(souffle, tgt, over)
        result, report, src = _build(imported, souffle, tgt, nvcc)
        nvcc_seconds += report.nvcc.get("seconds", 0.0)
    if souffle is not None and souffle.stitched and report.nvcc.get("available"):
        # Second pass where needed: each cooperative kernel gets the grid its measured registers
        # and shared memory allow (the first build used the static estimate's).
        grids = _coresident_grids(report, souffle)
        if grids:
            progress.step(f"restitching {len(grids)} cooperative kernel(s) with the grid ptxas allows")
            again = pipeline.restitch(souffle, tgt, grids)
            result2, report2, src2 = _build(imported, again, tgt, nvcc)
            nvcc_seconds += report2.nvcc.get("seconds", 0.0)
            try:
                _check_coresidency(report2, str(tgt.attrs["arch"]))
                if _spills(report2) > _spills(report) and _coresident(report, str(tgt.attrs["arch"])):
                    # ptxas allocates the new grid's code differently and spills: the first
                    # build's grid was co-resident already, so it stays
                    progress.step("the restitched kernels spill; keeping the first build's grids")
                else:
                    souffle, result, report, src = again, result2, report2, src2
            except StitchError:
                # the new grid changed the code enough not to fit: one block per SM always does
                sms = {k.function: hardware.for_arch(str(tgt.attrs["arch"])).sms for k in souffle.stitched
                       if not k.refused}
                souffle = pipeline.restitch(souffle, tgt, sms)
                result, report, src = _build(imported, souffle, tgt, nvcc)
                nvcc_seconds += report.nvcc.get("seconds", 0.0)
    if is_cuda(tgt) and report.nvcc.get("available"):
        _check_coresidency(report, str(tgt.attrs["arch"]))      # never launch a grid that cannot be co-resident
    if souffle is not None:
        imported = dataclasses.replace(imported, mod=souffle.mod, params=souffle.params)
    result.seconds = time.perf_counter() - t0 - nvcc_seconds     # nvcc is reported on its own
    report.compile_seconds = round(result.seconds, 3)
    report.nvcc["seconds"] = round(nvcc_seconds, 3)
    report.fusion = fusion
    if fusion == "souffle":
        report.fallback = fallback
        if souffle is not None:
            report.level = level
            report.groups = [{"name": g.name, "members": [m.op.name for m in g.members] or [g.name],
                              "reason": g.reason} for g in souffle.partition.groups]
            report.group_edges = group_edges(souffle.program, souffle.partition.groups)
            report.subprograms = [{"groups": [souffle.partition.groups[i].name for i in idx],
                                   "indices": list(idx), "reason": why}
                                  for idx, why in souffle.subprograms]
            for kr in report.kernels:
                sk = next((k for k in souffle.stitched if k.function == kr.primfunc), None)
                if sk is not None:
                    kr.stages, kr.grid_syncs = sk.stages, sk.grid_syncs
                    kr.prefetched_bytes = sk.prefetched_bytes or None
                    kr.bytes = sum(result.footprints[sk.function].values())
            report.bytes = sum(k.launches * k.bytes for k in report.kernels)    # with the stitched kernels' own
            if database is not None:
                report.database = database
                _schedule_sources(report, souffle)
    progress.clear()     # the caller prints next: no half line of progress in front of it
    return Compiled(imported, tgt, result.executable, report, src)
