"""Drop-in passes: the Souffle pipeline as ``tvm.transform.Pass`` objects on a Relax IRModule.

Between ``LowerToTE`` and ``PartitionAndEmit`` the module carries its TEProgram in the module
attribute ``souffle.te_program``; each transform reads it, rewrites it and stores it back, so
the passes compose in ``tvm.transform.Sequential`` and respect ``PassContext``
(``disabled_pass=["souffle.HorizontalFusion"]`` turns one off; instruments see each one).
``PartitionAndEmit`` replaces ``main`` with calls to one PrimFunc per kernel group and leaves
the weights ``main`` now takes in the attribute ``souffle.params`` (:func:`params_of`).
``StitchSubprograms`` (v3, CUDA) joins consecutive groups into cooperative kernels and
``PlantPrefetch`` (v4) adds their L2 prefetches. ``SoufflePipeline`` is all of them for a level:

    seq = tvm.transform.Sequential([relax.transform.FoldConstant(),
                                    SoufflePipeline(target, params, Options(level="v3"))])
    mod = seq(mod)
    ex = tvm.compile(mod, target, tir_pipeline=COOPERATIVE_TIR_PIPELINE)

Weights come either separately (``params``, or the ``params`` attribute of ``main``; ``main``
then takes the new weights after its inputs, :func:`params_of`) or bound into ``main`` as
constants (``relax.transform.BindParams``, TVM's ``from_onnx`` default): then ``LowerToTE``
takes the floating-point tensor constants as the weights and ``BindWeights`` binds the new
weights back, so ``main`` keeps taking only its inputs. ``RequireCooperativeLaunch`` (v3, CUDA)
makes each stitched kernel trap at entry when launched without the cooperative flag, and warns
that the build needs ``COOPERATIVE_TIR_PIPELINE``. ``souffle_tvm.transform`` re-exports them.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import numpy as np
import tvm
import tvm_ffi
from tvm import relax

from ..build import cooperative
from ..codegen import emit
from ..cost import hardware, prior
from ..core.root_block import ensure_root_blocks
from ..core.targets import is_cuda
from ..core.geometry import STITCH_BLOCK
from ..errors import CooperativeBuildWarning, SouffleError
from ..partition import by_time, kernels, subprograms, window_prices
from ..partition.block_choice import TIME_BLOCKS
from ..partition.groups import readers_of, outputs_of
from ..stitch import prefetch
from ..stitch.module import kernel_name, stitch_module
from ..te import program as te_program
from ..transforms import fold_weights, horizontal, step_slices, two_phase, vertical
from ..planning import at_block_sizes, block_counts, fused_or_alone, joint_tiles, partials, schedules
from ..planning.group_calls import GroupCalls
from ..planning.group_facts import group_facts
from .options import LEVEL_DISABLES, Feedback, Options

PROGRAM = "souffle.te_program"
INFO = "souffle.info"
PARAMS = "souffle.params"
BOUND = "bound_weights"     # INFO key: LowerToTE took the weights from constants; BindWeights binds them back


def _program(mod: tvm.IRModule) -> te_program.TEProgram:
    if mod.attrs is None or PROGRAM not in mod.attrs:
        raise SouffleError("this Souffle pass needs a TEProgram: run souffle_tvm.pipeline.passes.LowerToTE() first")
    return mod.attrs[PROGRAM]


def _info(mod: tvm.IRModule) -> dict:
    return dict(mod.attrs[INFO]) if mod.attrs is not None and INFO in mod.attrs else {}


def _gemm_k_tile(info: dict) -> int | None:
    """The K tile the user fixed for the stitched GEMMs (None: chosen per GEMM)."""
    return int(info.get("gemm_k_tile", 0)) or None


def _store(mod: tvm.IRModule, prog, **info) -> tvm.IRModule:
    merged = {**_info(mod), **info}
    return mod.with_attr(PROGRAM, tvm_ffi.convert(prog)).with_attr(INFO, tvm_ffi.convert(merged))


def with_program(mod: tvm.IRModule, prog: te_program.TEProgram) -> tvm.IRModule:
    """Attach an already lowered TEProgram (what ``LowerToTE`` does)."""
    return _store(mod, prog)


def with_info(mod: tvm.IRModule, **info) -> tvm.IRModule:
    """``mod`` with these entries added to what the passes recorded (e.g. to stitch it again)."""
    return mod.with_attr(INFO, tvm_ffi.convert({**_info(mod), **info}))


def info_of(mod: tvm.IRModule) -> dict:
    """What the passes recorded: transform results, the partition, the stitched kernels."""
    return _info(mod)


def params_of(mod: tvm.IRModule) -> list[np.ndarray]:
    """The weights the emitted ``main`` takes after its inputs."""
    return list(mod.attrs[PARAMS]) if mod.attrs is not None and PARAMS in mod.attrs else []


def without_records(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` without the passes' records (what is built)."""
    for key in [k for k in (INFO, PARAMS, PROGRAM) if mod.attrs is not None and k in mod.attrs]:
        mod = mod.without_attr(key)
    return mod


def _constants_as_weights(prog: te_program.TEProgram) -> te_program.TEProgram:
    """Bound weights as weights: the floating-point constants with at least one axis become
    weights with their values (what the transforms may rewrite: stack, fold); integer constants
    stay constants, which the vertical transform folds into indices."""
    moved = [t for t in prog.constants if len(t.shape) >= 1 and str(t.dtype).startswith(("float", "bfloat"))]
    prog.weights = list(prog.weights) + moved
    prog.weight_values = {**prog.weight_values, **{t.op: prog.constants[t] for t in moved}}
    prog.constants = {t: v for t, v in prog.constants.items() if t not in set(moved)}
    return prog


@tvm.transform.module_pass(opt_level=0, name="souffle.LowerToTE")
class LowerToTE:
    """Relax ``main`` → one TEProgram (weights as placeholders, their values when given).

    ``params``: the weight arrays in ``main``'s parameter order after the inputs; if None,
    the ``params`` function attribute that ``from_onnx(keep_params_in_input=True)`` leaves;
    if neither and ``main`` takes only its inputs, the weights are bound into it as constants
    (``relax.transform.BindParams``), and those are taken as the weights. ``steps``: ``step_slices`` first.
    """

    def __init__(self, params: list | None = None, steps: bool = False):
        self.params, self.steps = params, steps

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        params = self.params
        mod = step_slices.sink(mod)[0] if self.steps else mod
        main = mod["main"]
        if params is None and main.attrs is not None and "params" in main.attrs:
            params = [p.numpy() for p in main.attrs["params"]]
        prog = te_program.lower(mod, weight_values=params)
        if params is None and not prog.weights:
            return _store(mod, _constants_as_weights(prog), **{BOUND: True})
        return _store(mod, prog)


def _transform_pass(name: str, fn, key: str, doc: str):
    @tvm.transform.module_pass(opt_level=0, name=name)
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        result = fn(_program(mod))
        return _store(mod, result.program, **{key: result})

    _pass.__doc__ = doc
    return _pass


def FoldWeights() -> tvm.transform.Pass:  # noqa: N802 - named like TVM's pass constructors
    """Evaluate weight-only stages at compile time (see ``transforms.fold_weights``)."""
    return _transform_pass("souffle.FoldWeights", fold_weights, "fold_weights", fold_weights.__doc__)


def HorizontalFusion() -> tvm.transform.Pass:  # noqa: N802
    """Merge isomorphic independent contractions (see ``transforms.horizontal``)."""
    return _transform_pass("souffle.HorizontalFusion", horizontal, "horizontal", horizontal.__doc__)


def VerticalFusion() -> tvm.transform.Pass:  # noqa: N802
    """Compose one-to-one chains into consumers (see ``transforms.vertical``)."""
    return _transform_pass("souffle.VerticalFusion", vertical, "vertical", vertical.__doc__)


def TwoPhaseReduction(atomic: bool = False, judged: bool = False,  # noqa: N802
                      gemm_tile: int | None = None, row_chains: bool = True) -> tvm.transform.Pass:
    """Split GEMM-fed row reductions into block partials and a combine (see ``transforms.two_phase``);
    ``atomic``: fp32 sums accumulate with atomicAdd instead (CUDA); ``judged``: only where the
    latency model predicts the split faster (``planning.partials.split_pays``); ``gemm_tile``: the SIMT
    GEMM tile side the options fix (None: the one each GEMM's schedule sizes to the grid);
    ``row_chains``: the reductions of a row chain (``te.chains``; attention's softmax) stay
    whole, for the chain's kernel to hold its rows on chip."""
    judge = partials.split_pays if judged else None
    return _transform_pass("souffle.TwoPhaseReduction",
                           lambda prog: two_phase(prog, lambda gemm: partials.gemm_tile(gemm, gemm_tile),
                                                  atomic=atomic, judge=judge,
                                                  whole=partials.held_whole(prog) if row_chains else None),
                           "two_phase", two_phase.__doc__)


def _target(target) -> tvm.target.Target:
    return target or tvm.target.Target.current(allow_none=True) or tvm.target.Target({"kind": "llvm"})


@tvm.transform.module_pass(opt_level=0, name="souffle.PartitionAndEmit")
class PartitionAndEmit:
    """Draw kernel boundaries (with schedule feedback on CUDA) and emit one PrimFunc per group."""

    def __init__(self, target: tvm.target.Target | None = None, block_size: int | None = None,
                 gemm_k_tile: int | None = None, database=None, gemm_tile: int | None = None,
                 row_chains: bool = True):
        self.target = target
        self.block_size = block_size
        self.gemm_k_tile, self.gemm_tile = gemm_k_tile, gemm_tile
        self.database = database
        self.row_chains = row_chains

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        prog = _program(mod)
        target = _target(self.target)
        scheduled = schedules.ScheduleCache(target, self.block_size, self.gemm_k_tile, self.database,
                                           self.gemm_tile)
        part = kernels.partition_groups(prog, self.row_chains)
        readers = readers_of(prog)
        # Schedule feedback, in topological order (the schedule cache keeps the first of equal
        # functions it meets, so the order is part of what is built): the partitioner splits
        # what the code generator cannot schedule as well as the anchor alone.
        pending, done = list(part.groups), []
        while pending:
            g = pending.pop(0)
            parts = [g] if g.opaque is not None else kernels.split_unschedulable(
                g, fused_or_alone.why_not_fused(scheduled, g, outputs_of(g, readers), readers))
            if len(parts) == 1:
                done.append(g)
            else:
                pending[:0] = parts
        part.groups = done
        notes = []      # per non-opaque group: the rules passed over, each with why

        def schedule(func):
            done = scheduled(func)
            notes.append((list(done.notes), done.failures))
            return done.func

        out = emit.emit_module(prog, part, schedule=schedule, funcs=scheduled.group_funcs)
        unscheduled = emit.emit_module(prog, part, funcs=scheduled.group_funcs)
        if self.block_size is not None and is_cuda(target):
            # consumers cut into their producers' blocks where that makes the edge block-local
            aligned = joint_tiles.align(GroupCalls(out, part.groups), unscheduled, target,
                                        self.block_size, scheduled)
            for name, (stamped, func) in aligned.items():
                unscheduled[name], out[name] = stamped, func
        info = {**_info(mod), "partition": part, "program": prog,
                "unscheduled": unscheduled,
                "schedule_notes": notes, "rule_failures": scheduled.failures,
                # the K tile the groups are scheduled with again at the other block sizes (0: chosen)
                "gemm_k_tile": self.gemm_k_tile or 0}
        return (out.with_attr(PARAMS, tvm_ffi.convert([tvm.runtime.tensor(a) for a in prog.weight_arrays()]))
                .with_attr(INFO, tvm_ffi.convert(info)))


@tvm.transform.module_pass(opt_level=0, name="souffle.StitchSubprograms")
class StitchSubprograms:
    """Join consecutive groups into subprograms (``partition.subprograms``) and stitch each into
    ONE cooperative kernel (``stitch.module``). CUDA only; the groups must have been scheduled
    with ``STITCH_BLOCK`` threads (``PartitionAndEmit(block_size=STITCH_BLOCK)``).

    ``feedback``: what a build with ptxas found (cuts to force, grids to launch). ``onchip``:
    keep block-local intermediates in shared memory (``stitch.channel``). ``waves``: the budget
    counts a group's code once per kernel (``subprograms.code_repeats``)."""

    def __init__(self, target: tvm.target.Target | None = None, partitioner: str = "budget",
                 feedback: Feedback | None = None, onchip: bool = True, waves: bool = False):
        self.target, self.partitioner = target, partitioner
        self.feedback = feedback or Feedback()
        self.onchip, self.waves = onchip, waves

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        target = _target(self.target)
        info = _info(mod)
        if "partition" not in info:
            raise SouffleError("StitchSubprograms needs the groups of PartitionAndEmit: run it first")
        prog, groups = info["program"], info["partition"].groups
        clean = without_records(mod)
        calls = GroupCalls(clean, groups)
        gpu = hardware.for_arch(str(target.attrs["arch"]))
        grids = self.feedback.grids
        estimated = grids is None and self.feedback.estimated_grids
        sizes = self.partitioner in ("budget", "time") or estimated
        facts = info.get("group_facts")     # the same groups stitched again (ptxas feedback): asked once
        if facts is None or (sizes and not facts.statements):
            facts = group_facts(calls, target, sizes=sizes, unscheduled=info.get("unscheduled"))
        at = None     # the groups at every block size (time and budget partitioners)
        if self.partitioner == "blocks":
            subs = subprograms.by_normalization(groups, readers_of(prog), facts.unstitchable)
        elif self.partitioner == "time":
            timer = window_prices.Timer(facts, gpu, prior.current().constants, measured=prior.current().measured)
            alone = fused_or_alone.schedules_alone(clean, info["unscheduled"], groups, target, timer)
            # every window priced at each block size too: the size can draw the boundaries
            at = at_block_sizes.at_sizes(clean, info["unscheduled"], groups, target, timer, asked=info.get("at_sizes"),
                                         sizes=TIME_BLOCKS, gemm_k_tile=_gemm_k_tile(info))
            at_block_sizes.faster_alone(at, alone)
            subs = by_time.by_time(groups, facts, gpu, readers_of(prog), forced=self.feedback.forced, timer=timer,
                                   sizes=at.others())
        else:
            subs = subprograms.by_budget(groups, subprograms.cut_cost(prog, groups),
                                         subprograms.code_repeats(facts) if self.waves else facts, gpu,
                                         forced=self.feedback.forced)
        if estimated:
            # first build: as many blocks as the static estimate lets be co-resident; the build
            # checks them against ptxas' figures and the driver re-stitches where they differ
            grids = {kernel_name(k): subprograms.estimated_grid(facts, idx, gpu)
                     for k, (idx, _) in enumerate(subs) if len(idx) > 1 and all(i in calls.call_index for i in idx)}
        built, sized = clean, at_block_sizes.StitchedBlocks()
        if self.partitioner == "time":
            # what stays alone is built as v2 builds it; ``clean`` (kept as "unstitched") keeps the
            # stitchable schedules, so a ptxas-feedback restitch can still join any groups
            built = fused_or_alone.reschedule_alone(clean, groups, subs, alone)
        if self.partitioner in ("budget", "time"):
            # each stitched subprogram runs at the block size predicted fastest
            if self.partitioner == "budget":
                at = at_block_sizes.at_sizes(clean, info["unscheduled"], groups, target,
                                             window_prices.Timer(facts, gpu, prior.current().constants),
                                             {i for idx, _ in subs if len(idx) > 1 for i in idx}, info.get("at_sizes"),
                                             gemm_k_tile=_gemm_k_tile(info))
            producers = window_prices.producers_of(groups, readers_of(prog))
            sized = at_block_sizes.block_sizes(at, clean, groups, subs, producers, self.feedback.partition_block)
            if estimated:
                grids.update(sized.grids)
        out, stitched = stitch_module(built, target, calls.subprogram_calls(subs), grid=gpu.sms,
                                      block=STITCH_BLOCK, grids=grids, min_blocks=self.feedback.min_blocks,
                                      blocks=sized.blocks, onchip=self.onchip)
        # what a block of each stage executes, as the partitioner counted it: the report prices
        # the built kernel's stages as it priced them
        work = {STITCH_BLOCK: facts.work, **({b: t.facts.work for b, t in at.others().items()} if at else {})}
        for k in stitched:
            k.block_reason = sized.why.get(k.index)
            k.counted_alone = block_counts.counted_alone(k.stage_ids, work.get(k.block), calls)
        if mod.attrs is not None and PARAMS in mod.attrs:
            out = out.with_attr(PARAMS, mod.attrs[PARAMS])
        return out.with_attr(INFO, tvm_ffi.convert({**info, "unstitched": clean, "stitched": stitched,
                                                    "subprograms": subs, "group_facts": facts,
                                                    **({"at_sizes": at} if at is not None else {})}))


@tvm.transform.module_pass(opt_level=0, name="souffle.PlantPrefetch")
class PlantPrefetch:
    """V4: each stitched kernel prefetches the inputs of its next segment into L2 before the grid
    sync that precedes it (``stitch.prefetch``), except the kernels named in ``skip`` (those
    ptxas found over budget with their prefetch loops)."""

    def __init__(self, target: tvm.target.Target | None = None, skip: frozenset = frozenset()):
        self.target = target
        self.skip = skip

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        info = _info(mod)
        if "stitched" not in info:
            raise SouffleError("PlantPrefetch needs stitched kernels: run StitchSubprograms first")
        gpu = hardware.for_arch(str(_target(self.target).attrs["arch"]))
        planted, stitched = prefetch.plant_module(without_records(mod), list(info["stitched"]), gpu.l2_bytes,
                                                  set(self.skip))
        if mod.attrs is not None and PARAMS in mod.attrs:
            planted = planted.with_attr(PARAMS, mod.attrs[PARAMS])
        return planted.with_attr(INFO, tvm_ffi.convert({**info, "stitched": stitched}))


COOPERATIVE_BUILD_NOTE = (
    "souffle-tvm: the module has stitched cooperative kernels (they grid-sync): build it with "
    "tvm.compile(mod, target, tir_pipeline=COOPERATIVE_TIR_PIPELINE), imported from souffle_tvm.transform "
    "(or souffle_tvm.build.cooperative); with TVM's default TIR pipeline they launch without the "
    "cooperative flag and trap at entry")


@tvm.transform.module_pass(opt_level=0, name="souffle.RequireCooperativeLaunch")
class RequireCooperativeLaunch:
    """Each stitched kernel checks at entry that it was launched as a cooperative grid and traps
    if not (a build with TVM's default TIR pipeline would otherwise reach its first grid sync
    uncooperatively); warns once that the build needs ``COOPERATIVE_TIR_PIPELINE``, which
    launches them cooperatively and drops the check (``build.cooperative``)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        out, guarded = cooperative.guard_grid_sync(mod.clone())     # clone: the caller's module stays as it was
        if guarded:
            warnings.warn(COOPERATIVE_BUILD_NOTE, CooperativeBuildWarning, stacklevel=2)
        # the module goes to the user's tvm.compile: stitched kernels under a root block, as TVM's
        # Relax passes require of every PrimFunc (the driver's build adds them itself)
        return ensure_root_blocks(out)


@tvm.transform.module_pass(opt_level=0, name="souffle.BindWeights")
class BindWeights:
    """Bound weights in, bound weights out: where ``LowerToTE`` took the weights from constants,
    the weights the emitted ``main`` takes (:func:`params_of`) are bound back as constants, so
    ``main`` takes only its inputs and ``tvm.compile`` builds a self-contained module."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        if not _info(mod).get(BOUND):
            return mod
        main = mod["main"]
        n = int(main.attrs["num_input"]) if main.attrs is not None and "num_input" in main.attrs else len(main.params)
        bound = dict(zip(main.params[n:], params_of(mod)))     # runtime tensors already
        out = relax.transform.BindParams("main", bound)(mod) if bound else mod
        return out.with_attr(PARAMS, tvm_ffi.convert([]))


def SoufflePipeline(target: tvm.target.Target | None = None, params: list | None = None,  # noqa: N802
                    options: Options | None = None, lower: bool = True, database=None,
                    feedback: Feedback | None = None, *, level: str | None = None,
                    cooperative_guard: bool = True) -> tvm.transform.Pass:
    """The passes of ``options.level`` (default v2): LowerToTE → FoldWeights → HorizontalFusion (v1+)
    → VerticalFusion (v2+) → TwoPhaseReduction (v3+) → PartitionAndEmit → StitchSubprograms (v3+,
    CUDA) → PlantPrefetch (v4, CUDA) → RequireCooperativeLaunch (v3+, CUDA) → BindWeights.

    ``target``: None takes the current one (``with target:``), when the pass is made or else
    when it runs (inside ``tvm.compile``, its target; llvm when there is none).
    ``params``: the weights, separately (None: from ``main``'s ``params`` attribute, or bound
    into ``main`` as constants). ``level``: short for ``Options(level=...)`` (overrides
    ``options.level``). ``lower=False`` starts from a module that already carries its TEProgram
    (``with_program``). ``database``: an open MetaSchedule database
    (``codegen.database.open_database``) whose tuned schedules replace the default rules for the
    groups it holds. ``feedback``: for stitching. ``cooperative_guard=False`` leaves out
    ``RequireCooperativeLaunch`` (the driver, which always builds with the cooperative pipeline).
    """
    options = options or Options()
    options = replace(options, level=level) if level is not None else options

    def make(target: tvm.target.Target) -> tvm.transform.Pass:
        return _pipeline(target, params, options, lower, database, feedback, cooperative_guard)

    target = target or tvm.target.Target.current(allow_none=True)
    # which passes run depends on the target (stitching is CUDA's): without one yet, choose when it runs
    return make(target) if target is not None else _AtCurrentTarget(make)


@tvm.transform.module_pass(opt_level=0, name="souffle.PipelineAtCurrentTarget")
class _AtCurrentTarget:
    """``SoufflePipeline`` made for the target current when it runs (``tvm.compile`` sets it)."""

    def __init__(self, make):
        self.make = make

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return self.make(_target(None))(mod)


def _pipeline(target: tvm.target.Target, params: list | None, options: Options, lower: bool, database,
              feedback: Feedback | None, cooperative_guard: bool) -> tvm.transform.Pass:
    options = options.check(target)
    stitching = options.stitches(target)
    steps = [LowerToTE(params, options.step_slices(target))] if lower else []
    # the time-driven partitioner's objective judges the two-phase splits too
    judged = options.partitioner == "time"
    steps += [FoldWeights(), HorizontalFusion(), VerticalFusion(),
              TwoPhaseReduction(options.reduction == "atomic", judged, options.gemm_tile, options.onchip),
              PartitionAndEmit(target, STITCH_BLOCK if stitching else None,
                               options.gemm_k_tile if stitching else None, database,
                               options.gemm_tile if stitching else None, options.onchip)]
    if stitching:
        steps += [StitchSubprograms(target, options.partitioner, feedback, options.onchip, options.waves),
                  PlantPrefetch(target, (feedback or Feedback()).no_prefetch)]
        steps += [RequireCooperativeLaunch()] if cooperative_guard else []
    steps.append(BindWeights())
    left_out = LEVEL_DISABLES[options.level]
    return tvm.transform.Sequential([s for s in steps if s.info.name not in left_out], opt_level=0,
                                    name="souffle.Pipeline")
