"""ptxas overrules the partitioner's estimate: stitch again until every kernel fits.

After the first build, each stitched kernel's registers, shared memory and spills are known.
A kernel that spills or leaves fewer blocks co-resident than the GPU has SMs is first stitched
without its V4 prefetch (if it had one), else at the partition's block size (if the model gave
it another, ``partition.block_choice``), else cut in two where the fewest bytes cross; then
each cooperative kernel gets the grid its measured figures let be co-resident; last, a kernel
whose registers alone hold its blocks per SM down gets a register cap (``__launch_bounds__``)
where the latency model predicts the extra block per SM faster, kept only if ptxas then
spills no more.
"""

from __future__ import annotations

import dataclasses
import warnings

from ..build.executable import BuildResult
from ..core import progress
from ..cost import hardware
from ..core.geometry import STITCH_BLOCK
from ..errors import CoresidencyError, OverBudgetWarning, SouffleError
from ..frontend.importer import ImportedModel
from ..partition.subprograms import cut_cost, split_point
from ..report.assemble import check_coresidency, with_stitched_facts
from ..report.schema import Report
from .building import build_and_report
from .register_caps import graph_seconds, one_more_block, register_caps
from .results import SouffleModule, restitch

MAX_FEEDBACK_ROUNDS = 6   # each round halves the kernels that did not fit


def over_budget(report: Report, souffle: SouffleModule, arch: str) -> dict[str, str]:
    """{stitched kernel function: what ptxas found} for kernels that spill or leave no block of
    the kernel co-resident on an SM: the partitioner's estimate was wrong about them."""
    gpu = hardware.for_arch(arch)
    stitched = {k.function for k in souffle.stitched if len(k.stages) > 1}
    out = {}
    for k in report.kernels:
        if k.primfunc not in stitched or k.registers is None:
            continue
        if k.spill_bytes:
            out[k.primfunc] = f"{k.spill_bytes} B of register spills ({k.registers} registers)"
        elif k.cooperative and (k.max_coresident or 0) < gpu.sms:   # no grid sync: nothing to wait for
            out[k.primfunc] = (f"{k.registers} registers and {k.shared_bytes} B shared memory leave "
                               f"{k.max_coresident} blocks co-resident, fewer than the {gpu.sms} SMs")
    return out


def _split(souffle: SouffleModule, why: dict[str, str]) -> dict[int, str]:
    """The forced cuts after this round: every subprogram whose stitched kernel is in ``why`` is
    cut in two, where the fewest extra bytes cross (earlier forced cuts are kept)."""
    groups = souffle.partition.groups
    cost = cut_cost(souffle.program, groups)
    forced = dict(souffle.feedback.forced)
    for k in souffle.stitched:
        idx = souffle.subprograms[k.index][0]
        if k.function in why and len(idx) > 1:
            cut = split_point(cost, idx)
            forced[cut] = f"ptxas feedback: {why[k.function]}; split after {groups[cut].name}"
    return forced


# Wider grids a settled build tries at most (each a rebuild: nvcc and ptxas again).
WIDEN_TRIES = 2


def _spills(report: Report) -> int:
    return sum(k.spill_bytes or 0 for k in report.kernels if k.cooperative)


def _coresident(report: Report, arch: str) -> bool:
    try:
        check_coresidency(report, arch)
        return True
    except CoresidencyError:
        return False


def coresident_grids(report: Report, souffle: SouffleModule) -> dict[str, int]:
    """{stitched kernel function: blocks} where the grid launched (from the static estimate)
    differs from what ptxas' figures let be co-resident and the stages can use: fewer (needed,
    or grid.sync() could deadlock) or more (more parallelism)."""
    stitched = {k.function: k for k in souffle.stitched}
    out = {}
    for k in report.kernels:
        sk = stitched.get(k.primfunc)
        if sk is not None and k.cooperative and k.max_coresident:
            want = min(k.max_coresident, sk.max_blocks)
            if want != sk.grid:
                out[k.primfunc] = want
    return out


@dataclasses.dataclass
class Built:
    souffle: SouffleModule
    result: object
    report: Report
    source: str | None
    nvcc_seconds: float


def settle(imported: ImportedModel, souffle: SouffleModule, target, use_nvcc: bool) -> Built:
    """Build, and while ptxas finds a stitched kernel over budget, stitch again and rebuild;
    then give each cooperative kernel the grid its measured figures allow, a register cap
    where one more block per SM is predicted faster and ptxas spills no more (``_capped``), and
    then a wider grid where the settled build's own figures allow one and it pays (``_widened``)."""
    arch = str(target.attrs["arch"])
    result, report, src = build_and_report(imported, souffle, target, use_nvcc)
    seconds = report.nvcc.get("seconds", 0.0)
    rounds = MAX_FEEDBACK_ROUNDS if souffle.options.partitioner in ("budget", "time") and souffle.stitched else 0
    for round_ in range(rounds):
        over = over_budget(report, souffle, arch) if report.nvcc.get("available") else {}
        if not over:
            break
        prefetching = {k.name for k in souffle.stitched if k.function in over and k.prefetched_bytes}
        resized = {tuple(souffle.subprograms[k.index][0]) for k in souffle.stitched
                   if k.function in over and k.block != STITCH_BLOCK}
        if prefetching:
            # V4's prefetch loops are what the kernel gives up first: V3's form of it may fit
            n = len({k.function for k in souffle.stitched if k.name in prefetching})
            progress.step(f"ptxas feedback: dropping the L2 prefetch of {n} kernel(s) that did "
                          "not fit with it", round_ + 1, MAX_FEEDBACK_ROUNDS)
            fb = dataclasses.replace(souffle.feedback, no_prefetch=souffle.feedback.no_prefetch | prefetching)
        elif resized:
            # a kernel the model gave another block size goes back to the partition's first
            progress.step(f"ptxas feedback: {len(resized)} kernel(s) did not fit at the block size chosen; "
                          f"stitching them at {STITCH_BLOCK} threads", round_ + 1, MAX_FEEDBACK_ROUNDS)
            fb = dataclasses.replace(souffle.feedback, partition_block=souffle.feedback.partition_block | resized)
        else:
            progress.step(f"ptxas feedback: splitting {len(over)} kernel(s) that did not fit", round_ + 1,
                          MAX_FEEDBACK_ROUNDS)
            fb = dataclasses.replace(souffle.feedback, forced=_split(souffle, over))
        souffle, result, report, src, took = _rebuild(imported, souffle, target, fb, use_nvcc)
        seconds += took
    else:
        still = over_budget(report, souffle, arch) if rounds and report.nvcc.get("available") else {}
        if still:
            warnings.warn(f"ptxas feedback: after {MAX_FEEDBACK_ROUNDS} rounds, "
                          + "; ".join(f"{f}: {why}" for f, why in sorted(still.items()))
                          + " (kept: slower than planned)", OverBudgetWarning, stacklevel=2)
    if souffle.stitched and report.nvcc.get("available"):
        # Each cooperative kernel gets the grid its measured registers and shared memory allow
        # (the first build used the static estimate's).
        grids = coresident_grids(report, souffle)
        if grids:
            progress.step(f"restitching {len(grids)} cooperative kernel(s) with the grid ptxas allows")
            by_name = {k.name: grids.get(k.function, k.grid) for k in souffle.stitched}
            again, result2, report2, src2, took = _rebuild(
                imported, souffle, target, dataclasses.replace(souffle.feedback, grids=by_name), use_nvcc)
            seconds += took
            try:
                check_coresidency(report2, arch)
                if _spills(report2) > _spills(report) and _coresident(report, arch):
                    # ptxas allocates the new grid's code differently and spills: the first
                    # build's grid was co-resident already, so it stays
                    progress.step("the restitched kernels spill; keeping the first build's grids")
                else:
                    souffle, result, report, src = again, result2, report2, src2
            except CoresidencyError:
                # the new grid changed the code enough not to fit: one block per SM always does
                sms = {k.name: hardware.for_arch(arch).sms for k in souffle.stitched}
                souffle, result, report, src, took = _rebuild(
                    imported, souffle, target, dataclasses.replace(souffle.feedback, grids=sms), use_nvcc)
                seconds += took
        capped, extra = _capped(imported, souffle, result, report, target, use_nvcc)
        seconds += extra
        if capped is not None:
            souffle, result, report, src = capped
        # after the caps, and only if faster than what they gave: a wider grid taken first can
        # leave no cap that builds without spills (EfficientNet-B0 v3: 0.420 ms against 0.411)
        widened, extra = _widened(imported, souffle, result, report, target, use_nvcc)
        seconds += extra
        if widened is not None:
            souffle, result, report, src = widened
    return Built(souffle, result, report, src, seconds)


def _rebuild(imported: ImportedModel, souffle: SouffleModule, target, feedback, use_nvcc: bool):
    """The same groups stitched again with ``feedback``, built: (souffle, result, report,
    source, nvcc seconds)."""
    again = restitch(souffle, target, feedback)
    result, report, src = build_and_report(imported, again, target, use_nvcc)
    return again, result, report, src, report.nvcc.get("seconds", 0.0)


def _pays(report: Report, planned_s: float, again: SouffleModule, result2, report2: Report, arch: str) -> bool:
    """Whether a rebuild (``again``, ``result2``, ``report2``) of the build ``report`` (predicted
    ``planned_s`` under a graph) is kept: it spills no more, every grid is co-resident and the
    latency model predicts it faster (it has no spill term: a change is taken only where it costs none)."""
    return _spills(report2) <= _spills(report) and _coresident(report2, arch) and graph_seconds(
        with_stitched_facts(report2, result2, again.stitched, again.unstitched), arch) < planned_s


def _widened(imported: ImportedModel, souffle: SouffleModule, result: BuildResult, report: Report, target,
             use_nvcc: bool) -> tuple[tuple | None, float]:
    """((souffle, result, report, source) with wider grids, or None, and the nvcc seconds it took).
    A kernel's registers can fall with its grid (a grid-stride loop where each block had one tile:
    BERT-base's stitched v3 kernel, 178 registers at its 288 blocks, 79 at 132), so the grid the
    first build's figures allowed can leave blocks per SM unused. Where the settled build allows
    more co-resident blocks than it launches, more are launched, at most ``WIDEN_TRIES`` ways from
    the most blocks per SM down, each under the register cap that keeps them co-resident
    (``__launch_bounds__``, as ``_capped`` builds it); the first that spills no more, is
    co-resident and is predicted faster is kept."""
    arch = str(target.attrs["arch"])
    gpu = hardware.for_arch(arch)
    launched = {k.function: k.grid for k in souffle.stitched}
    wider = {f: g for f, g in coresident_grids(report, souffle).items() if g > launched.get(f, g)}
    if not wider:
        return None, 0.0
    planned = graph_seconds(with_stitched_facts(report, result, souffle.stitched, souffle.unstitched), arch)
    most = max(-(-g // gpu.sms) for g in wider.values())
    least = min(launched[f] // gpu.sms for f in wider) + 1
    seconds = 0.0
    for per_sm in list(range(most, least - 1, -1))[:WIDEN_TRIES]:
        grids = {f: min(g, per_sm * gpu.sms) for f, g in wider.items()}
        grids = {f: g for f, g in grids.items() if g > launched[f]}
        if not grids:
            break
        progress.step(f"widening {len(grids)} cooperative kernel(s) to {per_sm} blocks per SM, registers capped")
        fb = dataclasses.replace(
            souffle.feedback, grids={k.name: grids.get(k.function, k.grid) for k in souffle.stitched},
            min_blocks={**souffle.feedback.min_blocks,
                        **{k.name: -(-grids[k.function] // gpu.sms) for k in souffle.stitched if k.function in grids}})
        try:
            again, result2, report2, src, took = _rebuild(imported, souffle, target, fb, use_nvcc)
        except (SouffleError, RuntimeError, ValueError) as err:   # TVM raises built-ins; optional: the build stands
            progress.step(f"wider grids not built ({str(err).splitlines()[0][:200]})")
            return None, seconds
        seconds += took
        if _pays(report, planned, again, result2, report2, arch):
            return (again, result2, report2, src), seconds
    progress.step("the wider grids spill, do not fit or are not predicted faster: kept")
    return None, seconds


def _capped(imported: ImportedModel, souffle: SouffleModule, result: BuildResult, report: Report, target,
            use_nvcc: bool) -> tuple[tuple | None, float]:
    """((souffle, result, report, source) built with register caps (``register_caps``), or None,
    and the nvcc seconds it took). None where no cap is proposed, the capped build fails, spills
    more, is not co-resident, or is not predicted faster after all: the build given stays."""
    arch = str(target.attrs["arch"])
    gpu = hardware.for_arch(arch)
    if not any(one_more_block(gpu, row) for row in report.kernels):
        return None, 0.0          # the usual case: no stage plans to make, nothing to build
    planned = with_stitched_facts(report, result, souffle.stitched, souffle.unstitched)
    caps = register_caps(planned, souffle.stitched, arch)
    if not caps:
        return None, 0.0
    for function, (_, _, why) in caps.items():
        progress.step(f"register cap for {function}: {why}")
    by_name = {k.name: k.function for k in souffle.stitched}
    fb = dataclasses.replace(souffle.feedback,
                             grids={k.name: caps[k.function][1] if k.function in caps else k.grid for k in souffle.stitched},
                             min_blocks={n: caps[f][0] for n, f in by_name.items() if f in caps})
    try:
        again, result2, report2, src, seconds = _rebuild(imported, souffle, target, fb, use_nvcc)
    except (SouffleError, RuntimeError, ValueError) as err:   # TVM raises built-ins; an optional step: the build stands
        progress.step(f"register caps not built ({str(err).splitlines()[0][:200]}): no cap")
        return None, 0.0
    if not _pays(report, graph_seconds(planned, arch), again, result2, report2, arch):
        progress.step("the capped kernels spill, do not fit or are not predicted faster: no cap")
        return None, seconds
    return (again, result2, report2, src), seconds
