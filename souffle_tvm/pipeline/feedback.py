"""ptxas overrules the partitioner's estimate: stitch again until every kernel fits, then keep
what pays.

After the first build, each stitched kernel's registers, shared memory and spills are known.
The loop works on the build's facts (``build.facts.BuildFacts``), never on a report, in two parts:

* **Repairs**, taken as they come, because the build is wrong without them: a kernel that spills
  or leaves fewer blocks co-resident than the GPU has SMs is stitched without its V4 prefetch
  (if it had one), else at the partition's block size (if the model gave it another,
  ``partition.block_choice``), else cut in two where the fewest bytes cross; then each
  cooperative kernel gets the grid its measured figures let be co-resident.
* **Improvements**, in the shape of Triton's autotuner: each proposer (``PROPOSERS``: register
  caps, then wider grids) prunes to the kernels it can help and offers rebuilds in rank order;
  each is built, and the first that passes the one accept test (``accept``: no more spills,
  every grid co-resident, predicted faster under a CUDA graph) is kept.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Iterator, Protocol

from ..build.executable import BuildResult
from ..build.facts import BuildFacts, check_coresidency
from ..core import progress
from ..core.geometry import STITCH_BLOCK
from ..cost import hardware
from ..errors import CoresidencyError, OverBudgetWarning, SouffleError
from ..frontend.importer import ImportedModel
from ..partition.subprograms import cut_cost, split_point
from ..planning.coresidency import coresident_grids, over_budget
from ..planning.register_caps import one_more_block, register_caps
from .building import build
from .options import Feedback
from .results import SouffleModule, restitch

MAX_FEEDBACK_ROUNDS = 6   # each round halves the kernels that did not fit


@dataclasses.dataclass
class Built:
    """One build of the model: the Souffle module, what TVM built, its facts, its CUDA source,
    and nvcc's seconds (this build's; ``settle``'s result: every build that led to it)."""
    souffle: SouffleModule
    result: BuildResult
    facts: BuildFacts
    source: str | None
    nvcc_seconds: float = 0.0


def graph_seconds(facts: BuildFacts) -> float:
    """The build's predicted time under a CUDA graph (an estimate): what an improvement must beat."""
    return facts.graph_seconds()


def accept(current: Built, candidate: Built) -> bool:
    """Whether ``candidate``, a rebuild of ``current``, is kept: it spills no more, every grid is
    co-resident and the latency model predicts it faster (it has no spill term: a change is taken
    only where it costs none)."""
    return (candidate.facts.spills() <= current.facts.spills() and candidate.facts.coresident()
            and graph_seconds(candidate.facts) < graph_seconds(current.facts))


def _build(imported: ImportedModel, souffle: SouffleModule, target, use_nvcc: bool) -> Built:
    result, facts, src = build(imported, souffle, target, use_nvcc)
    return Built(souffle, result, facts, src, facts.nvcc.get("seconds", 0.0))


def _rebuild(imported: ImportedModel, built: Built, target, feedback: Feedback, use_nvcc: bool) -> Built:
    """The same groups stitched again with ``feedback``, built (its nvcc seconds its own)."""
    return _build(imported, restitch(built.souffle, target, feedback), target, use_nvcc)


# -- repairs ------------------------------------------------------------------------------------
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


def _fitted(souffle: SouffleModule, over: dict[str, str], round_: int) -> Feedback:
    """The repair of kernels over budget, mildest first: drop their prefetch, else their block
    size, else cut them in two."""
    prefetching = {k.name for k in souffle.stitched if k.function in over and k.prefetched_bytes}
    resized = {tuple(souffle.subprograms[k.index][0]) for k in souffle.stitched
               if k.function in over and k.block != STITCH_BLOCK}
    if prefetching:
        # V4's prefetch loops are what the kernel gives up first: V3's form of it may fit
        n = len({k.function for k in souffle.stitched if k.name in prefetching})
        progress.step(f"ptxas feedback: dropping the L2 prefetch of {n} kernel(s) that did "
                      "not fit with it", round_ + 1, MAX_FEEDBACK_ROUNDS)
        return dataclasses.replace(souffle.feedback, no_prefetch=souffle.feedback.no_prefetch | prefetching)
    if resized:
        # a kernel the model gave another block size goes back to the partition's first
        progress.step(f"ptxas feedback: {len(resized)} kernel(s) did not fit at the block size chosen; "
                      f"stitching them at {STITCH_BLOCK} threads", round_ + 1, MAX_FEEDBACK_ROUNDS)
        return dataclasses.replace(souffle.feedback, partition_block=souffle.feedback.partition_block | resized)
    progress.step(f"ptxas feedback: splitting {len(over)} kernel(s) that did not fit", round_ + 1,
                  MAX_FEEDBACK_ROUNDS)
    return dataclasses.replace(souffle.feedback, forced=_split(souffle, over))


def _with_measured_grids(imported: ImportedModel, built: Built, target, use_nvcc: bool) -> tuple[Built, float]:
    """Each cooperative kernel at the grid its measured registers and shared memory allow (the
    first build used the static estimate's); where ptxas then spills and the first grids were
    co-resident, those stay; where the new grids do not fit, one block per SM. Returns the
    build and the nvcc seconds spent."""
    grids = coresident_grids(built.facts, built.souffle)
    if not grids:
        return built, 0.0
    progress.step(f"restitching {len(grids)} cooperative kernel(s) with the grid ptxas allows")
    souffle = built.souffle
    by_name = {k.name: grids.get(k.function, k.grid) for k in souffle.stitched}
    again = _rebuild(imported, built, target, dataclasses.replace(souffle.feedback, grids=by_name), use_nvcc)
    try:
        check_coresidency(again.facts)
    except CoresidencyError:
        # the new grid changed the code enough not to fit: one block per SM always does
        sms = {k.name: hardware.for_arch(str(target.attrs["arch"])).sms for k in souffle.stitched}
        last = _rebuild(imported, built, target, dataclasses.replace(souffle.feedback, grids=sms), use_nvcc)
        return last, again.nvcc_seconds + last.nvcc_seconds
    if again.facts.spills() > built.facts.spills() and built.facts.coresident():
        # ptxas allocates the new grid's code differently and spills: the first build's grid was
        # co-resident already, so it stays
        progress.step("the restitched kernels spill; keeping the first build's grids")
        return built, again.nvcc_seconds
    return again, again.nvcc_seconds


# -- improvements -------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Proposal:
    feedback: Feedback
    note: str | None = None      # what progress says before it is built


class Proposer(Protocol):
    """One kind of improvement: ``propose`` prunes to the kernels it can help and yields rebuilds
    in rank order (best first); ``failed`` and ``rejected`` are what progress says when a
    rebuild raises (the proposer then stops) or none passes ``accept``."""
    failed: str
    rejected: str

    def propose(self, built: Built, gpu: hardware.GPU) -> Iterator[Proposal]: ...


class RegisterCaps:
    """A register cap (``__launch_bounds__``) where a kernel's registers alone hold its blocks per
    SM down and the latency model predicts one more block per SM faster
    (``planning.register_caps``); one proposal, all such kernels capped together."""
    failed = "register caps not built"
    rejected = "the capped kernels spill, do not fit or are not predicted faster: no cap"

    def propose(self, built: Built, gpu: hardware.GPU) -> Iterator[Proposal]:
        if not any(one_more_block(gpu, row) for row in built.facts.kernels):
            return          # the usual case: no stage plans to make, nothing to build
        souffle = built.souffle
        caps = register_caps(built.facts, souffle.stitched, built.facts.arch)
        if not caps:
            return
        for function, (_, _, why) in caps.items():
            progress.step(f"register cap for {function}: {why}")
        by_name = {k.name: k.function for k in souffle.stitched}
        yield Proposal(dataclasses.replace(
            souffle.feedback,
            grids={k.name: caps[k.function][1] if k.function in caps else k.grid for k in souffle.stitched},
            min_blocks={n: caps[f][0] for n, f in by_name.items() if f in caps}))


# Wider grids a settled build tries at most (each a rebuild: nvcc and ptxas again).
WIDEN_TRIES = 2


class WiderGrids:
    """A kernel's registers can fall with its grid (a grid-stride loop where each block had one
    tile: BERT-base's stitched v3 kernel, 178 registers at its 288 blocks, 79 at 132), so the grid
    the first build's figures allowed can leave blocks per SM unused. Where the settled build
    allows more co-resident blocks than it launches, more are launched, at most ``WIDEN_TRIES``
    ways from the most blocks per SM down, each under the register cap that keeps them
    co-resident. Proposed after the caps: a wider grid taken first can leave no cap that builds
    without spills (EfficientNet-B0 v3: 0.420 ms against 0.411)."""
    failed = "wider grids not built"
    rejected = "the wider grids spill, do not fit or are not predicted faster: kept"

    def propose(self, built: Built, gpu: hardware.GPU) -> Iterator[Proposal]:
        souffle = built.souffle
        launched = {k.function: k.grid for k in souffle.stitched}
        wider = {f: g for f, g in coresident_grids(built.facts, souffle).items() if g > launched.get(f, g)}
        if not wider:
            return
        most = max(-(-g // gpu.sms) for g in wider.values())
        least = min(launched[f] // gpu.sms for f in wider) + 1
        for per_sm in list(range(most, least - 1, -1))[:WIDEN_TRIES]:
            grids = {f: min(g, per_sm * gpu.sms) for f, g in wider.items()}
            grids = {f: g for f, g in grids.items() if g > launched[f]}
            if not grids:
                return
            yield Proposal(dataclasses.replace(
                souffle.feedback, grids={k.name: grids.get(k.function, k.grid) for k in souffle.stitched},
                min_blocks={**souffle.feedback.min_blocks,
                            **{k.name: -(-grids[k.function] // gpu.sms) for k in souffle.stitched
                               if k.function in grids}}),
                f"widening {len(grids)} cooperative kernel(s) to {per_sm} blocks per SM, registers capped")


PROPOSERS: tuple[Proposer, ...] = (RegisterCaps(), WiderGrids())


def _improved(imported: ImportedModel, built: Built, target, use_nvcc: bool,
              proposer: Proposer) -> tuple[Built, float]:
    """``built``, or the first of ``proposer``'s rebuilds that ``accept`` keeps, and the nvcc
    seconds of the rebuilds tried."""
    gpu = hardware.for_arch(str(target.attrs["arch"]))
    seconds, tried = 0.0, False
    for proposal in proposer.propose(built, gpu):
        tried = True
        if proposal.note:
            progress.step(proposal.note)
        try:
            candidate = _rebuild(imported, built, target, proposal.feedback, use_nvcc)
        except (SouffleError, RuntimeError, ValueError) as err:   # TVM raises built-ins; optional: the build stands
            progress.step(f"{proposer.failed} ({str(err).splitlines()[0][:200]})")
            return built, seconds
        seconds += candidate.nvcc_seconds
        if accept(built, candidate):
            return candidate, seconds
    if tried:
        progress.step(proposer.rejected)
    return built, seconds


def settle(imported: ImportedModel, souffle: SouffleModule, target, use_nvcc: bool) -> Built:
    """Build; repair while ptxas finds a stitched kernel over budget, then give each cooperative
    kernel the grid its measured figures allow; then each proposer's improvements, kept where
    ``accept`` says they pay."""
    arch = str(target.attrs["arch"])
    built = _build(imported, souffle, target, use_nvcc)
    seconds = built.nvcc_seconds
    rounds = MAX_FEEDBACK_ROUNDS if souffle.options.partitioner in ("budget", "time") and souffle.stitched else 0
    for round_ in range(rounds):
        over = over_budget(built.facts, built.souffle, arch) if built.facts.nvcc.get("available") else {}
        if not over:
            break
        built = _rebuild(imported, built, target, _fitted(built.souffle, over, round_), use_nvcc)
        seconds += built.nvcc_seconds
    else:
        still = over_budget(built.facts, built.souffle, arch) if rounds and built.facts.nvcc.get("available") else {}
        if still:
            warnings.warn(f"ptxas feedback: after {MAX_FEEDBACK_ROUNDS} rounds, "
                          + "; ".join(f"{f}: {why}" for f, why in sorted(still.items()))
                          + " (kept: slower than planned)", OverBudgetWarning, stacklevel=2)
    if built.souffle.stitched and built.facts.nvcc.get("available"):
        built, spent = _with_measured_grids(imported, built, target, use_nvcc)
        seconds += spent
        for proposer in PROPOSERS:
            built, spent = _improved(imported, built, target, use_nvcc, proposer)
            seconds += spent
    return dataclasses.replace(built, nvcc_seconds=seconds)
