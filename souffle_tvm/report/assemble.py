"""A Report from a build (its kernels, their ptxas figures) and the pipeline's decisions.

Each function reads plain data: the ``BuildResult`` of ``build.executable``, ptxas figures of
``build.ptxas``, and for Souffle its partition, subprograms and stitched kernels.
"""

from __future__ import annotations

import dataclasses

from tvm import tirx

from ..build.executable import BuildResult, DeviceKernel
from ..codegen.database import schedule_source
from ..cost import tir_stats
from ..cost.hardware import for_arch, occupancy
from ..core.ir_names import FORM_ATTR
from ..cost.measured import timed_in_a_total
from ..core.targets import describe
from ..errors import CoresidencyError
from ..partition.groups import group_edges
from ..stitch.module import function_runs
from .schema import KernelReport, Report
from ..cost.work import Stage


def _kernel_flops(kernels: list[DeviceKernel], flops: dict[str, int]) -> list[int]:
    """Split a PrimFunc's block flops over its kernels by which kernel stores each block's buffer."""
    if len(kernels) <= 1:         # none: a function that launches nothing (``NothingToWrite``)
        return [sum(flops.values())] if kernels else []
    out = [0] * len(kernels)
    for buf, f in flops.items():
        owner = next((i for i, k in enumerate(kernels) if buf in k.stored), 0)
        out[owner] += f
    return out


def _kernel_bytes(kernel: DeviceKernel, footprint: dict) -> int:
    """Compulsory traffic of one launch: each global buffer's accessed footprint (``footprint``:
    parameter position -> bytes; whole size where the unscheduled TIR has no region for it,
    e.g. scheduler-made temporaries)."""
    return sum(min(footprint.get(key, size), size) for key, size in kernel.global_buffers.items())


def cuda_report(name: str, target, result: BuildResult, figures: dict | None, nvcc: dict) -> Report:
    """Per device kernel its launch, ptxas figures (``figures``: kernel name -> resources, None
    without nvcc), bytes and flops; ``nvcc``: {available, seconds, note}."""
    by_func: dict[str, list[DeviceKernel]] = {}
    for k in result.kernels:
        by_func.setdefault(k.primfunc, []).append(k)
    kernels = []
    for pf, calls in result.calls.items():
        ks = by_func.get(pf, [])
        for k, fl in zip(ks, _kernel_flops(ks, result.flops.get(pf, {}))):
            r = figures.get(k.name) if figures else None
            kernels.append(KernelReport(
                k.name, pf, k.grid, k.block, r.registers if r else None,
                (r.shared_bytes if r else 0) + k.dyn_shared_bytes if (r or not figures) else None,
                r.spill_bytes if r else None, calls, _kernel_bytes(k, result.footprints.get(pf, {})), fl,
                cooperative=k.cooperative, tensor_core=k.tensor_core,
                written_bytes=sum(min(result.footprints.get(pf, {}).get(n, v), v)
                                  for n, v in k.global_buffers.items() if n in k.stored),
                elem_bytes=k.elem_bytes, block_counts=k.counts.as_dict() if k.counts else None))
    distinct = len({k.name for k in result.kernels if k.primfunc in result.calls})
    return _totals(name, describe(target).split()[0], str(target.attrs["arch"]), kernels, distinct,
                   result.seconds, nvcc)


def cpu_report(name: str, result: BuildResult) -> Report:
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


def add_stitched_work(result: BuildResult, stitched: list) -> None:
    """A stitched kernel does its stages' work and moves their traffic (intermediates included:
    without two-phase reductions they still pass through global memory)."""
    for k in stitched:
        # Once per call: a function called many times (an LSTM's GEMV) counts each time, and a
        # function lowered to several launch regions counts once (its first region).
        calls = [st.function for st in k.stage_ids if st.region in (None, 0)]
        result.flops[k.function] = {f"{i}:{st}:{b}": f for i, st in enumerate(calls)
                                    for b, f in result.flops.get(st, {}).items()}
        # keyed by (stage, parameter position): every stage's buffers counted, none merged
        result.footprints[k.function] = {f"{i}:{pos}": v for i, st in enumerate(calls)
                                         for pos, v in result.footprints.get(st, {}).items()}


def check_coresidency(report: Report, arch: str, raise_: bool = True) -> None:
    """A cooperative grid must fit on the GPU at once, or grid.sync() deadlocks: refuse the build
    (or, with ``raise_=False``, only fill in each kernel's co-resident limit)."""
    gpu = for_arch(arch)
    for k in report.kernels:
        if not k.cooperative or k.registers is None:
            continue
        occ = occupancy(gpu, k.block[0] * k.block[1] * k.block[2], k.registers, k.shared_bytes or 0)
        k.max_coresident = occ.max_coresident(gpu)
        blocks = k.grid[0] * k.grid[1] * k.grid[2]
        if raise_ and blocks > k.max_coresident:
            raise CoresidencyError(f"{k.name}: a grid of {blocks} blocks cannot be co-resident on {gpu.name} "
                                   f"(at most {k.max_coresident}: {occ.blocks_per_sm}/SM, limited by {occ.limited_by})")


def stage_plan(result: BuildResult, sk, stage_funcs: dict) -> list[dict]:
    """Per stage of stitched kernel ``sk``: the tiles and threads it would launch as a kernel of its
    own, its bytes and flops (a stage function lowered to several launch regions counts them,
    and the global scratch it passes between them, on its first), and whether it runs on
    tensor cores. Bytes are those leaving the chip: a tensor a stage reads from (or writes only
    to) an on-chip channel counts in its ``onchip_bytes`` instead."""
    plan = []
    run_of = {run[0]: run for run in function_runs(sk.stage_ids)}
    for i, (st, geometry) in enumerate(zip(sk.stage_ids, sk.geometry)):
        first = st.region in (None, 0)
        func = sk.stage_func(st.function, stage_funcs)
        # a function lowered to several launch regions passes data between them in global scratch
        scratch = tir_stats.global_scratch_bytes(func) if func is not None and st.region == 0 else 0
        nbytes = sum(result.footprints.get(st.function, {}).values()) + scratch if first else 0
        flops = sum(result.flops.get(st.function, {}).values()) if first else 0
        stage = (tir_stats.work_stages(func, [geometry], nbytes, flops)[0] if func is not None
                 else Stage(*geometry, nbytes, flops))
        # the function's first region carries its bytes: every region's on-chip reads come off there
        run = run_of.get(i, [i]) if first and func is not None else []
        # a resident input's first reader reads what its fill copies, not its own footprint of it
        filled = {pos: b for j in run for pos, b in (sk.filled[j] if j < len(sk.filled) else {}).items()}
        onchip = sorted({pos for j in run for pos in (sk.onchip[j] if j < len(sk.onchip) else [])} - set(filled))
        footprint = result.footprints.get(st.function, {})
        # a position past the parameters is a global scratch buffer between the function's kernels
        scratch = tir_stats.global_scratch_buffers(func) if onchip else []
        saved = sum(footprint.get(pos, tir_stats.buffer_bytes(func.params[pos])) if pos < len(func.params)
                    else tir_stats.buffer_bytes(scratch[pos - len(func.params)])
                    for pos in onchip if pos - len(func.params) < len(scratch))
        unwritten = sum(tir_stats.buffer_bytes(func.params[pos]) for pos in onchip
                        if pos in tir_stats.stored_positions(func)) if onchip else 0
        refill = sum(b - footprint.get(pos, tir_stats.buffer_bytes(func.params[pos])) for pos, b in filled.items())
        stage = dataclasses.replace(stage, bytes=stage.bytes - saved + refill,
                                    written_bytes=max(stage.written_bytes - unwritten, 0))
        if not first:      # only a function's first region carries what it stores
            stage = dataclasses.replace(stage, written_bytes=0)
        stage = _with_counts_alone(stage, sk.counted_alone[i] if i < len(sk.counted_alone) else None, saved - refill)
        plan.append({**dataclasses.asdict(stage), **({"onchip_bytes": saved} if saved else {})})
    return plan


def _with_counts_alone(stage: Stage, alone: dict | None, onchip: int) -> Stage:
    """``stage`` with what a block of it executes as the partitioner counted it (``alone``: the
    stage stitched alone at the kernel's block size), where the tiles are the same: a stitched
    kernel's own counts are of its busiest and last blocks, all stages together, so a stage of few
    tiles and many sectors is priced as those tiles' SMs move them, as the partitioner priced it.
    Global sectors scale with the bytes left off chip (``onchip``: what its channels took, less
    what a resident input's fill reads instead: a fill's loads are sectors too), as the
    partitioner's on-chip credit scales them. A stage whose tiles differ keeps the kernel's counts
    alone (no rule tiles a stage differently stitched today)."""
    if alone is None or alone["tiles"] != stage.tiles:
        return stage
    counted = dataclasses.replace(stage, sectors=alone["sectors"], k_steps=alone["k_steps"],
                                  shared_wavefronts=alone["shared_wavefronts"])
    if onchip <= 0:
        return counted
    return dataclasses.replace(counted, bytes=stage.bytes + onchip).read_on_chip(onchip)


def add_souffle_decisions(report: Report, result: BuildResult, level: str, partition, program,
                          subprograms: list, stitched: list, schedule_notes: list, rule_failures: int,
                          unstitched=None) -> None:
    """The groups with their reasons (and the schedule rules passed over, ``schedule_notes``:
    per non-opaque group the "Rule: why" notes and how many rules raised), the group DAG, the
    subprograms, and per stitched kernel its stages, grid syncs, prefetch and its own bytes
    (its stages' footprints). ``rule_failures``: schedule rules that raised, over every group
    the partitioner asked about (candidates it then split included)."""
    report.level = level
    report.groups = [{"name": g.name, "members": [m.op.name for m in g.members] or [g.name], "reason": g.reason,
                      **({"window_chain": g.window_reason} if g.window_at else {})}
                     for g in partition.groups]
    scheduled = [entry for entry, g in zip(report.groups, partition.groups) if g.opaque is None]
    for entry, (notes, _) in zip(scheduled, schedule_notes):
        if notes:
            entry["schedule_notes"] = notes
    report.rule_failures = rule_failures
    report.group_edges = group_edges(program, partition.groups)
    report.subprograms = [{"groups": [partition.groups[i].name for i in idx], "indices": list(idx), "reason": why}
                          for idx, why in subprograms]
    for k in stitched:     # a block size other than the partitioner's, and why
        if k.block_reason and k.index < len(report.subprograms):
            report.subprograms[k.index].update(block=k.block, block_reason=k.block_reason)
    with_stitched_facts(report, result, stitched, unstitched)


def with_stitched_facts(report: Report, result: BuildResult, stitched: list, unstitched=None) -> Report:
    """``report`` (changed in place, and returned) with each stitched kernel's stages, grid
    syncs, prefetch, register cap, own bytes (its stages' footprints) and stage plan: what the
    latency model reads. ``unstitched``: the module holding the stage PrimFuncs."""
    stage_funcs = {gv.name_hint: f for gv, f in unstitched.functions.items()
                   if isinstance(f, tirx.PrimFunc)} if unstitched is not None else {}
    for kr in report.kernels:
        sk = next((k for k in stitched if k.function == kr.primfunc), None)
        if sk is not None:
            kr.stages, kr.grid_syncs = sk.stages, sk.grid_syncs
            kr.prefetched_bytes = sk.prefetched_bytes or None
            kr.min_blocks = sk.min_blocks
            kr.stage_plan = stage_plan(result, sk, stage_funcs)
            kr.bytes = sum(st["bytes"] for st in kr.stage_plan)     # its stages' footprints
            kr.on_chip = {"stages": sum(bool(p) for p in sk.onchip), "channel_bytes": sk.onchip_bytes,
                          "resident_inputs": list(sk.resident_inputs), "resident_bytes": sk.resident_bytes,
                          "saved_bytes": sum(st.get("onchip_bytes", 0) for st in kr.stage_plan)}
    report.bytes = sum(k.launches * k.bytes for k in report.kernels)    # with the stitched kernels' own
    return report


def add_reductions(report: Report, two_phase) -> None:
    """The two-phase transform's record: each row reduction split (its form) and each other
    GEMM-fed row reduction with why it was kept whole."""
    if two_phase is not None:
        report.reductions = {"split": dict(two_phase.split), "kept": dict(two_phase.kept)}


def add_forms(report: Report, mod, unstitched=None, stitched: list = ()) -> None:
    """Per kernel its schedule form and whether a GPU has ever run that form (``cost.measured``):
    the rule and block size each group PrimFunc was scheduled with (``FORM_ATTR``), a stitched
    kernel's stages' forms joined; a function without one is TVM's own (dlight's rules)."""
    funcs = {gv.name_hint: f for gv, f in mod.functions.items() if isinstance(f, tirx.PrimFunc)}
    stages = {gv.name_hint: f for gv, f in (unstitched or mod).functions.items() if isinstance(f, tirx.PrimFunc)}
    by_function = {k.function: k for k in stitched}

    def form(func) -> str:
        attrs = func.attrs if func is not None and func.attrs is not None else {}
        return str(attrs[FORM_ATTR]) if FORM_ATTR in attrs else "dlight"

    for kr in report.kernels:
        if kr.primfunc in by_function:
            sk = by_function[kr.primfunc]
            kr.form = " + ".join(dict.fromkeys(form(sk.stage_func(st.function, stages)) for st in sk.stage_ids))
        else:
            kr.form = form(funcs.get(kr.primfunc))
        kr.measured_form = timed_in_a_total(kr.form)


def add_schedule_sources(report: Report, mod, unstitched, stitched: list) -> None:
    """Per kernel: did its schedule come from the tuning database or from the default rules
    (a stitched kernel counts its stages)."""
    funcs = {gv.name_hint: f for gv, f in mod.functions.items() if isinstance(f, tirx.PrimFunc)}
    stages = {gv.name_hint: f for gv, f in (unstitched or mod).functions.items() if isinstance(f, tirx.PrimFunc)}
    ids = {k.function: k.stage_ids for k in stitched}
    for kr in report.kernels:
        if kr.stages:
            found = [schedule_source(stages[st.function]) for st in ids.get(kr.primfunc, []) if st.function in stages]
            n = sum(1 for src, _ in found if src == "database")
            kr.schedule = ("database" if found and n == len(found) else "default" if n == 0
                           else f"mixed: {n} of {len(found)} stages from the database")
            notes = sorted({note for _, note in found if note})
            kr.schedule_note = "; ".join(notes) or None
        elif kr.primfunc in funcs:
            kr.schedule, kr.schedule_note = schedule_source(funcs[kr.primfunc])
