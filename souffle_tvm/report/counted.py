"""Counted traffic beside the report's analytic bytes (issue 30, item 1).

The report's ``bytes`` per kernel are analytic (``cost.tir_stats.block_footprints``: each access
bounded as a box). ``runtime.traffic`` counts what the emulated kernels execute. ``attach`` gives
each kernel of a report its counted figures (``KernelReport.counted``) and holds the two side by
side, one comparison per unit the analytic figure describes:

* a kernel alone in its PrimFunc: its ``bytes`` against its distinct bytes;
* a PrimFunc lowered to several kernels: each kernel is charged its PrimFunc's footprint of every
  buffer it touches, so the PrimFunc is compared whole (its parameters' footprints against the
  distinct bytes of its parameters over all its launches);
* a stitched kernel: each stage function against its stage loops counted together as if alone
  (a function lowered to several launch regions is several stage loops; the analytic figure
  includes the global intermediates between them). ``count`` asks ``runtime.traffic`` for
  these groups (``stage_groups``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core import progress
from ..runtime import runner, traffic
from ..runtime.traffic import LaunchTraffic
from ..stitch.module import function_runs
from .schema import Report


@dataclass(frozen=True)
class Held:
    """One analytic figure against its count: ``unit`` names the kernel, PrimFunc or stage."""

    unit: str
    analytic: int
    counted: int

    @property
    def equal(self) -> bool:
        return self.analytic == self.counted


def stage_groups(stitched: list) -> dict[str, list[int]]:
    """Per stitched PrimFunc, per stage loop: the group of its stage function's launch regions
    (``runtime.traffic`` counts each group's distinct bytes)."""
    out = {}
    for sk in stitched:
        groups = [0] * len(sk.stage_ids)
        for g, run in enumerate(function_runs(sk.stage_ids)):
            for i in run:
                groups[i] = g
        out[sk.function] = groups
    return out


def attach(report: Report, counted: dict[tuple[str, int], LaunchTraffic], footprints: dict,
           stitched: list = ()) -> list[Held]:
    """Give each kernel of ``report`` its counted figures and return the comparisons (module doc).
    ``counted``: ``runtime.traffic.count``'s result for the module the report was built from;
    ``footprints``: the build's analytic footprints per PrimFunc (``BuildResult.footprints``);
    ``stitched``: the stitched kernels (``stitch.module.StitchedKernel``)."""
    by_function: dict[str, list] = {}
    for k in report.kernels:
        by_function.setdefault(k.primfunc, []).append(k)
    sk_of = {sk.function: sk for sk in stitched}
    held = []
    for function, kernels in by_function.items():
        for region, kr in enumerate(kernels):
            c = counted.get((function, region))
            if c is None:
                continue
            kr.counted = c.as_dict()
            if c.stages:
                kr.counted["stages"] = [st.as_dict() for st in c.stages]
        launches = [counted.get((function, r)) for r in range(len(kernels))]
        if any(c is None for c in launches):
            continue
        sk = sk_of.get(function)
        if sk is not None and kernels[0].stage_plan:
            stages = launches[0].stages
            groups = launches[0].group_bytes
            for g, run in enumerate(function_runs(sk.stage_ids)):
                if run[-1] >= len(stages) or g >= len(groups):
                    continue
                analytic = sum(kernels[0].stage_plan[i]["bytes"] for i in run)
                held.append(Held(f"{kernels[0].name}: {sk.stage_ids[run[0]].function}", analytic, groups[g]))
        elif len(kernels) == 1:
            held.append(Held(kernels[0].name, kernels[0].bytes, launches[0].distinct_bytes))
        else:
            held.append(Held(function, sum(footprints.get(function, {}).values()), launches[0].function_bytes))
    return held


def count(report: Report, mod, target, model, params: list, footprints: dict, stitched: list = (),
          seed: int = 0) -> list[Held]:
    """Run ``mod``'s kernels (the module ``report`` was built from) in the emulator on seeded
    inputs of ``model`` (``frontend.importer.ImportedModel``), attach the counts (``attach``) and
    the model's totals (``Report.counted``); returns the comparisons."""
    progress.step(f"counting traffic: the {len(report.kernels)} kernels run in the GPU emulator")
    feeds = runner.check_feeds(model.inputs, runner.random_inputs(model.inputs, seed))
    held = attach(report, traffic.count(mod, target, feeds, params, stage_groups(stitched)), footprints, stitched)
    counted = [k for k in report.kernels if k.counted]
    report.counted = {
        "bytes": sum(k.launches * k.counted["distinct_bytes"] for k in counted),
        "sector_bytes": sum(k.launches * k.counted["sectors"] * 32 for k in counted),
        "analytic_held": f"{sum(h.equal for h in held)} of {len(held)} equal",
        "differences": [{"unit": h.unit, "analytic": h.analytic, "counted": h.counted} for h in held if not h.equal],
    }
    return held
