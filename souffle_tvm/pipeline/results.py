"""Run the Souffle passes on an imported module and collect what they made and decided.

``run`` is the passes of one level in order (``passes.SoufflePipeline``), with the lowering
run first, outside the pass machinery, so a ``LoweringError`` reaches the caller as itself
(exceptions crossing TVM's FFI come back as RuntimeError) and the driver can fall back to
TVM's path. ``restitch`` stitches the same groups again with what ptxas said of a build.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import tvm

from ..codegen.database import open_database
from ..partition.groups import Partition
from ..partition.subprograms import MAX_GROUPS_PER_SUBPROGRAM
from ..te import program as te_program
from ..transforms import step_slices
from ..transforms.horizontal import HorizontalResult
from ..transforms.two_phase import TwoPhaseResult
from ..transforms.vertical import VerticalResult
from . import passes
from .options import Feedback, Options


@dataclass(frozen=True)
class SouffleModule:
    """What the passes made (``mod``, built next) and decided (groups, subprograms, kernels)."""

    mod: tvm.IRModule              # group PrimFuncs scheduled for the target (stitched at v3/v4)
    unscheduled: tvm.IRModule      # the same groups before scheduling (for flops/bytes)
    program: te_program.TEProgram
    partition: Partition
    params: list                   # weight arrays ``mod["main"]`` takes after the inputs
    options: Options
    vertical: VerticalResult | None = None
    horizontal: HorizontalResult | None = None
    two_phase: TwoPhaseResult | None = None          # reductions split in two, and why others were not
    stitched: list = field(default_factory=list)      # StitchedKernel per cooperative kernel
    subprograms: list = field(default_factory=list)   # (group indices, reason for the cut)
    unstitched: tvm.IRModule | None = None            # ``mod`` before stitching (to stitch again)
    feedback: Feedback = field(default_factory=Feedback)   # what the stitch was told by ptxas
    # per non-opaque group: (rules passed over as "Rule: why", how many of them raised)
    schedule_notes: list = field(default_factory=list)
    rule_failures: int = 0     # schedule rules that raised, candidate groups included
    group_facts: object = None  # what the subprogram partitioner was told of each group (kept for restitch)
    at_sizes: object = None     # the same at every block size (``planning.at_block_sizes.AtSizes``; kept for restitch)


def run(mod: tvm.IRModule, target: tvm.target.Target, params: list, options: Options | None = None,
        feedback: Feedback | None = None) -> SouffleModule:
    """Apply the Souffle passes of ``options.level`` to an imported module (inputs then weights
    as ``main``'s parameters). ``feedback``: how to stitch (v3/v4 on CUDA)."""
    options = (options or Options()).check(target)
    feedback = feedback or Feedback()
    database = open_database(options.database) if options.database is not None else None
    sunk = step_slices.sink(mod)[0] if options.step_slices(target) else mod     # as LowerToTE does
    sunk = passes.with_program(sunk, te_program.lower(sunk, weight_values=params))
    with tvm.transform.PassContext(opt_level=3):
        # no entry check: the driver always builds with the cooperative TIR pipeline
        out = passes.SoufflePipeline(target, params, options, lower=False, database=database,
                                     feedback=feedback, cooperative_guard=False)(sunk)
    souffle = _collect(out, options, feedback)
    if options.waves and any(k.written_out > MAX_GROUPS_PER_SUBPROGRAM for k in souffle.stitched):
        # the waves did not roll, and with the step takes moved the layers' steps do not either
        # (each reads the layer below's, made outside its run): the layer order, as without waves
        return run(mod, target, params, dataclasses.replace(options, waves=False), feedback)
    return souffle


def _collect(out: tvm.IRModule, options: Options, feedback: Feedback) -> SouffleModule:
    info = passes.info_of(out)
    return SouffleModule(passes.without_records(out), info["unscheduled"], info["program"], info["partition"],
                         [p.numpy() for p in passes.params_of(out)], options, info.get("vertical"),
                         info.get("horizontal"), info.get("two_phase"), list(info.get("stitched", [])),
                         [(list(idx), why) for idx, why in info.get("subprograms", [])], info.get("unstitched"),
                         feedback, [(list(n), int(f)) for n, f in info.get("schedule_notes", [])],
                         int(info.get("rule_failures", 0)), info.get("group_facts"), info.get("at_sizes"))


def restitch(souffle: SouffleModule, target: tvm.target.Target, feedback: Feedback) -> SouffleModule:
    """The same groups stitched again, told ``feedback`` (cuts, grids, kernels without prefetch)."""
    facts = {k: v for k, v in (("group_facts", souffle.group_facts), ("at_sizes", souffle.at_sizes)) if v is not None}
    mod = passes.with_info(souffle.unstitched, program=souffle.program, partition=souffle.partition, **facts,
                           unscheduled=souffle.unscheduled)
    steps = [passes.StitchSubprograms(target, souffle.options.partitioner, feedback, souffle.options.onchip,
                                      souffle.options.step_slices(target))]
    if souffle.options.level == "v4":
        steps.append(passes.PlantPrefetch(target, feedback.no_prefetch))
    out = tvm.transform.Sequential(steps)(mod)
    again = _collect(out, souffle.options, feedback)
    return dataclasses.replace(again, params=souffle.params, vertical=souffle.vertical,
                               horizontal=souffle.horizontal, two_phase=souffle.two_phase,
                               schedule_notes=souffle.schedule_notes, rule_failures=souffle.rule_failures)
