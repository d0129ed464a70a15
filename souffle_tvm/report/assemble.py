"""A Report rendered once from what was built and decided: the build's facts
(``build.facts.BuildFacts``: kernels, ptxas figures, stage plans), then the pipeline's decisions
(groups and their reasons, subprograms, reductions), each kernel's schedule form and source.
Nothing here decides or prices: the feedback loop works on the facts, never on a Report.
"""

from __future__ import annotations

import dataclasses

from tvm import tirx

from ..build.facts import BuildFacts
from ..codegen.database import schedule_source
from ..core.ir_names import FORM_ATTR
from ..cost.measured import timed_in_a_total
from ..partition.groups import group_edges
from .schema import KernelReport, Report


def render(facts: BuildFacts) -> Report:
    """The report of a build: a row per kernel as built, and the totals (the pipeline's decisions,
    forms and predictions are added to it after)."""
    rows = [KernelReport(k.name, k.primfunc, k.grid, k.block, k.registers, k.shared_bytes, k.spill_bytes,
                         k.launches, k.bytes, k.flops, stages=k.stages, grid_syncs=k.grid_syncs,
                         cooperative=k.cooperative, max_coresident=k.max_coresident,
                         prefetched_bytes=k.prefetched_bytes, tensor_core=k.tensor_core,
                         written_bytes=k.written_bytes, elem_bytes=k.elem_bytes,
                         stage_plan=[{**dataclasses.asdict(p.stage), **({"onchip_bytes": p.onchip_bytes}
                                                                         if p.onchip_bytes else {}),
                                      **({"phase": k.phases[i]} if k.phases else {})}
                                     for i, p in enumerate(k.stage_plan)] if k.stage_plan is not None else None,
                         launches_outside_graph=k.launches_outside_graph, min_blocks=k.min_blocks,
                         on_chip=k.on_chip, block_counts=k.counts.as_dict() if k.counts else None)
            for k in facts.kernels]
    return Report(model=facts.model, target=facts.target, arch=facts.arch, fusion="tvm",
                  launches=sum(k.launches for k in rows), distinct_kernels=facts.distinct,
                  compile_seconds=round(facts.seconds, 3),
                  bytes=sum(k.launches * k.bytes for k in rows),
                  flops=sum(k.launches * k.flops for k in rows), nvcc=facts.nvcc, kernels=rows)


def add_souffle_decisions(report: Report, level: str, partition, program, subprograms: list, stitched: list,
                          schedule_notes: list, rule_failures: int) -> None:
    """The groups with their reasons (and the schedule rules passed over, ``schedule_notes``:
    per non-opaque group the "Rule: why" notes and how many rules raised), the group DAG, the
    subprograms and each stitched kernel's block size where the model chose another.
    ``rule_failures``: schedule rules that raised, over every group
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
