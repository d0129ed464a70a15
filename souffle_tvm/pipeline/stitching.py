"""The Souffle pipeline driver: the passes of ``passes.py`` run in order, results collected.

``level`` selects the paper's ablation level by turning passes off by name:
v0 no transforms, v1 + horizontal, v2 + vertical (one kernel per anchor group, no grid sync),
v3 + stitching: each subprogram of groups becomes ONE cooperative kernel with grid syncs
(CUDA only; on llvm, the CPU twin, v3 builds the same groups as loop nests),
v4 + cross-stage optimisation: each stitched kernel prefetches the inputs of its next segment
into L2 before the grid sync that precedes it (``prefetch``; on llvm v4 is v3). Shared memory is
reused across stages already at v3 (TVM's storage planning of the stitched kernel).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import tvm
import tvm_ffi
from tvm import tirx

from ..partition import groups as partition
from . import passes
from ..te import program as te_program
from ..partition.groups import Partition
from ..core.geometry import STITCH_BLOCK
from ..core.targets import is_cuda
from ..transforms.horizontal import HorizontalResult
from ..transforms.two_phase import TwoPhaseResult
from ..transforms.vertical import VerticalResult

LEVELS = tuple(passes.LEVEL_DISABLES)
STITCHING_LEVELS = ("v3", "v4")


@dataclass
class SouffleModule:
    mod: tvm.IRModule              # group PrimFuncs scheduled for the target
    unscheduled: tvm.IRModule      # the same module before scheduling (for flops/bytes)
    program: te_program.TEProgram
    vertical: VerticalResult | None
    horizontal: HorizontalResult | None
    partition: Partition
    params: list                   # weight arrays ``mod["main"]`` takes after the inputs
    stitched: list = field(default_factory=list)      # StitchedKernel per cooperative kernel
    unstitched: tvm.IRModule | None = None            # ``mod`` before stitching (for restitch)
    subprograms: list = field(default_factory=list)   # (group indices, reason for the cut)
    two_phase: TwoPhaseResult | None = None           # reductions split in two, and why others were not
    partitioner: str = "budget"
    forced: dict = field(default_factory=dict)         # group index -> why a boundary must follow it
    estimated_grids: bool = False                      # first grids from the static estimate (checked later)
    prefetch: bool = False                             # V4: L2 prefetch of the next segment's inputs
    no_prefetch: set = field(default_factory=set)      # V4: kernels (by name) that spilled with it




PARTITIONERS = ("budget", "blocks")


def run(mod: tvm.IRModule, target: tvm.target.Target, params: list, level: str = "v2",
        gemm_k_tile: int | None = None, partitioner: str = "budget",
        estimated_grids: bool = False, reduction: str = "deterministic", database=None) -> SouffleModule:
    """Apply the Souffle pipeline to an imported module (inputs then weights as ``main`` params).

    ``gemm_k_tile``: the K tile of stitched GEMM stages (v3, CUDA; default 16); tiles over
    48 KB of shared memory go to dynamic shared memory. ``partitioner`` (v3): "budget", the
    resource-aware partitioner (``partition.subprograms_by_budget``), or "blocks", the first
    rule (a subprogram per attention / FFN block: cut after each normalisation).
    ``estimated_grids``: stitched grids as large as the static estimate lets be co-resident —
    only for a caller that checks them against ptxas before anything runs; otherwise one block
    per SM, which is co-resident whenever a block fits at all. ``reduction`` (v3): two-phase
    reductions with a partial buffer and a combine ("deterministic", the default) or, for fp32
    sums on CUDA, with atomicAdd ("atomic"). ``database``: tuned schedules (``souffle-tvm tune``)
    used for the groups they match, before the default rules."""
    if level not in LEVELS:
        raise ValueError(f"unknown level {level!r}; available: {', '.join(LEVELS)}")
    if reduction not in ("deterministic", "atomic"):
        raise ValueError(f"unknown reduction form {reduction!r}: deterministic or atomic")
    if reduction == "atomic" and not is_cuda(target):
        raise ValueError("atomic two-phase reductions are a CUDA option (the CPU twin is deterministic)")
    if partitioner not in PARTITIONERS:
        raise ValueError(f"unknown partitioner {partitioner!r}; available: {', '.join(PARTITIONERS)}")
    # Lowering runs first, outside the pass machinery, so a LoweringError reaches the caller
    # as itself (exceptions crossing TVM's FFI come back as RuntimeError) and the caller can
    # fall back to TVM's path; the transforms then run as the passes users compose.
    mod = passes.with_program(mod, te_program.lower(mod, weight_values=params))
    stitching = level in STITCHING_LEVELS and is_cuda(target)
    with tvm.transform.PassContext(opt_level=3, disabled_pass=passes.LEVEL_DISABLES[level]):
        out = passes.SoufflePipeline(target, params, lower=False, block_size=STITCH_BLOCK if stitching else None,
                                     gemm_k_tile=gemm_k_tile if stitching else None,
                                     atomic_reductions=reduction == "atomic", database=database)(mod)
    info = passes.info_of(out)
    clean = out.without_attr(passes.INFO).without_attr(passes.PARAMS)
    result = SouffleModule(clean, info["unscheduled"], info["program"], info.get("vertical"),
                           info.get("horizontal"), info["partition"], [p.numpy() for p in passes.params_of(out)],
                           two_phase=info.get("two_phase"))
    if stitching:
        result.partitioner = partitioner
        result.estimated_grids = estimated_grids
        result.prefetch = level == "v4"
        _stitch(result, target)
    return result


def restitch(result: SouffleModule, target: tvm.target.Target, grids: dict[str, int]) -> SouffleModule:
    """The same subprograms stitched again with per-kernel grid sizes (``{kernel function:
    blocks}``), e.g. the co-resident limit measured from the first build's registers. Every
    subprogram that shared a function gets the same grid, so they share one again."""
    import dataclasses

    again = dataclasses.replace(result, mod=result.unstitched)
    _stitch(again, target, {k.name: grids.get(k.function, k.grid) for k in result.stitched if not k.refused})
    return again


def drop_prefetch(result: SouffleModule, target: tvm.target.Target, functions: set[str]) -> SouffleModule:
    """Schedule feedback at V4: the stitched kernels calling ``functions`` (which ptxas found
    over budget with their prefetch loops) are stitched again without them, before any split."""
    import dataclasses

    names = {k.name for k in result.stitched if k.function in functions and k.prefetched_bytes}
    again = dataclasses.replace(result, mod=result.unstitched, no_prefetch=result.no_prefetch | names)
    _stitch(again, target)
    return again


def split(result: SouffleModule, target: tvm.target.Target, why: dict[str, str]) -> SouffleModule:
    """Schedule feedback: every subprogram whose stitched kernel is in ``why`` (``{kernel
    function: what ptxas found}``) is cut in two, where the fewest extra bytes cross, and the
    model stitched again (budget partitioner; earlier forced cuts are kept)."""
    import dataclasses

    cost = partition.cut_cost(result.program, result.partition.groups)
    forced = dict(result.forced)
    for k in result.stitched:
        idx = result.subprograms[int(k.name.rsplit("_", 1)[1])][0]    # souffle_stitched_<subprogram>
        if k.function in why and len(idx) > 1:
            cut = partition.split_point(cost, idx)
            forced[cut] = f"ptxas feedback: {why[k.function]}; split after {result.partition.groups[cut].name}"
    again = dataclasses.replace(result, mod=result.unstitched, forced=forced)
    _stitch(again, target)
    return again


def _stitch(result: SouffleModule, target: tvm.target.Target, grids: dict[str, int] | None = None) -> None:
    """Group the partition's kernels into subprograms and stitch each into one kernel."""
    from ..core import hardware
    from ..stitch import kernel as stitch

    groups = result.partition.groups
    call_index, n = {}, 0
    for i, g in enumerate(groups):
        if g.opaque is None:
            call_index[i] = n
            n += 1
    bindings = [b for blk in result.mod["main"].body.blocks for b in blk.bindings]
    calls = [b.value for b in bindings if _is_call_tir(b.value)]

    def func_of(i: int):
        return result.mod[calls[call_index[i]].args[0]]

    def stitchable(i: int) -> str | None:
        return stitch.why_not_stitchable(func_of(i), target, STITCH_BLOCK)

    gpu = hardware.for_arch(str(target.attrs["arch"]))
    lowered = _LoweredGroups(func_of, target)
    if result.partitioner == "blocks":
        subs = partition.subprograms_by_normalization(groups, partition.readers_of(result.program), stitchable)
    else:
        subs = partition.subprograms_by_budget(
            groups, partition.cut_cost(result.program, groups), stitchable, _fits(lowered, gpu),
            size=lowered.statements, forced=result.forced,
            signature=[tvm_ffi.structural_hash(func_of(i)) if g.opaque is None else None for i, g in enumerate(groups)],
            repeat_of=_repeats(bindings, calls, groups, call_index, func_of))
    if grids is None and result.estimated_grids:
        # First build: as many blocks as the static estimate lets be co-resident (at least one
        # per SM); the build checks the grid against ptxas' figures and the caller re-stitches
        # where they differ (api._coresident_grids).
        grids = {}
        for k, (idx, _) in enumerate(subs):
            if len(idx) > 1 and all(i in call_index for i in idx):
                est = lowered.estimate(idx)
                per_sm = hardware.occupancy(gpu, STITCH_BLOCK, est.registers, est.shared_bytes).blocks_per_sm
                grids[f"souffle_stitched_{k}"] = max(per_sm, 1) * gpu.sms
    result.unstitched = result.mod
    result.mod, result.stitched = stitch.stitch_module(
        result.mod, target, [[call_index[i] for i in idx if i in call_index] for idx, _ in subs],
        grid=gpu.sms, block=STITCH_BLOCK, grids=grids, prefetch_l2=gpu.l2_bytes if result.prefetch else None,
        no_prefetch=result.no_prefetch)
    result.subprograms = subs


def _is_call_tir(value) -> bool:
    return isinstance(value, tvm.relax.Call) and getattr(value.op, "name", "") == "relax.call_tir"


def _repeats(bindings: list, calls: list, groups: list, call_index: dict, func_of) -> list:
    """``rolling.repeats`` over the groups: each group's code skeleton, and its call's inputs as
    the group (and output) that makes them, or the Relax value itself."""
    from ..stitch import rolling
    from ..stitch.kernel import _Key

    group_of_call = {c: i for i, c in call_index.items()}
    maker, n = {}, 0
    for b in bindings:
        if _is_call_tir(b.value):
            maker[b.var] = (group_of_call[n], 0)
            n += 1
        elif isinstance(b.value, tvm.relax.TupleGetItem) and b.value.tuple_value in maker:
            maker[b.var] = (maker[b.value.tuple_value][0], b.value.index)
    sigs, reads = [], []
    for i, g in enumerate(groups):
        if g.opaque is not None:
            sigs.append(None)
            reads.append([])
            continue
        sigs.append(rolling.skeleton_hash(func_of(i)))
        reads.append([("group", *maker[a]) if a in maker else ("ext", _Key(a)) for a in calls[call_index[i]].args[1].fields])
    return rolling.repeats(sigs, reads)


class _LoweredGroups:
    """Each group's stages lowered once (for the estimate and the statement count)."""

    def __init__(self, func_of, target):
        self.func_of, self.target, self.cache, self.estimates = func_of, target, {}, {}

    def stages(self, i: int) -> list:
        if i not in self.cache:
            from ..stitch import kernel as stitch

            self.cache[i] = stitch.lower_stage("g", self.func_of(i), self.target)
        return self.cache[i]

    def estimate(self, indices: list[int]):
        """The static estimate of these groups stitched into one kernel (per-stage figures cached:
        the partitioner asks again for every group it grows a candidate by)."""
        from ..core import estimate

        for i in indices:
            if i not in self.estimates:
                self.estimates[i] = [estimate.stage(st.body) for st in self.stages(i)]
        return estimate.kernel([e for i in indices for e in self.estimates[i]])

    def statements(self, i: int) -> int:
        count = [0]
        for st in self.stages(i):
            tvm_ffi.structural_walk(st.body, (tirx.Stmt, lambda _: count.__setitem__(0, count[0] + 1)))
        return count[0]


def _fits(lowered: _LoweredGroups, gpu):
    """The budget of a candidate subprogram, from the static estimate of its stitched kernel:
    no spills, and at least one block per SM co-resident (the one-wave grid of the paper)."""
    from ..core import estimate, hardware

    def fits(indices: list[int]) -> str | None:
        est = lowered.estimate(indices)
        if est.spills:
            return f"registers: more than {estimate.MAX_REGISTERS} per thread (estimated), ptxas would spill"
        occ = hardware.occupancy(gpu, STITCH_BLOCK, est.registers, est.shared_bytes)
        if occ.blocks_per_sm < 1:
            return (f"{occ.limited_by}: {est.registers} registers, {est.shared_bytes} B shared memory per "
                    f"block (estimated) leave no block of {STITCH_BLOCK} threads co-resident on an SM")
        return None

    return fits
