"""The facts the partitioner decides from, asked of the code generator and the stitcher.

The partitioner (``souffle_tvm.partition``) decides every kernel boundary, but it cannot
schedule or lower code itself: it sits below the code generator. This module asks them, once
per group, and hands the answers down as data:

* ``ScheduleCache.why_not_fused``: whether a group schedules as well as its anchor alone
  (V2 schedule feedback; ``partition.kernels.split_unschedulable`` acts on it);
* ``group_facts``: per group whether it can be stitched, its size, the static resource
  estimate of its stages, its signature and repeats (``partition.subprograms.GroupFacts``);
* ``gemm_tile``: the output tile a GEMM's stitched schedule writes per block, which a two-phase
  partial can share (``transforms.two_phase`` takes it as its predicate).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
from pathlib import Path

import tvm
import tvm_ffi
from tvm import relax, te, tirx

from ..build import executable, ptxas
from ..codegen import emit, schedule
from ..codegen.database import lookup
from ..cost import estimate, hardware, latency, measured, tir_counts, tir_stats
from ..core.files import atomic_write, note_recomputed

from ..codegen.rules import StitchedMatmul, TensorCoreMatmul
from ..codegen.rules.gemm_tiles import block_count
from ..core.geometry import STITCH_BLOCK
from ..core.ir_names import FORM_ATTR, GEMM_TILE_ATTR, NOTE_ATTR, SOURCE_ATTR
from ..core.structural import ByStructure
from ..core.targets import is_cuda, make_target
from ..errors import ScheduleError, StitchError
from ..partition import by_time, kernels
from ..partition.groups import Group, outputs_of, readers_of
from ..partition.subprograms import GroupFacts
from ..stitch import rolling
from ..stitch import kernel, lower
from ..stitch.module import ExprKey
from ..te import chains
from ..transforms.two_phase import Candidate
from . import onchip_credit
from ..cost.work import BlockCounts, Stage


# The default rules' schedules, across compiles in one process (the rules are deterministic):
# (target, block size, K tile, GEMM tile, structural hash) -> [(group PrimFunc, Scheduled)]
_DEFAULT_SCHEDULES = ByStructure()


def default_schedule(func: tirx.PrimFunc, target, block_size: int | None = None, gemm_k_tile: int | None = None,
                     gemm_tile: int | None = None) -> schedule.Scheduled:
    """``schedule.schedule_group``, once per structurally distinct function and settings in a
    process (the two-phase pass asks for a GEMM's tile, the partitioner then schedules the same
    GEMM alone)."""
    return _DEFAULT_SCHEDULES(func, lambda: schedule.schedule_group(func, target, block_size, gemm_k_tile, gemm_tile),
                              key=(str(target), block_size, gemm_k_tile, gemm_tile))


class ScheduleCache:
    """Each structurally distinct group PrimFunc is scheduled once: from the tuning database
    when it holds a usable record for it (``database.lookup``), else by the default rules
    (whose schedules later compiles in the same process reuse)."""

    def __init__(self, target, block_size: int | None = None, gemm_k_tile: int | None = None, database=None,
                 gemm_tile: int | None = None):
        self.target = target
        self.block_size = block_size
        self.gemm_k_tile, self.gemm_tile = gemm_k_tile, gemm_tile
        self.database = database
        self.cache = ByStructure()
        self.failures = 0     # rules that raised, over every distinct function scheduled
        self.group_funcs = emit.GroupFuncs()    # the group PrimFuncs ``why_not_fused`` made (emit reuses them)

    def __call__(self, func) -> schedule.Scheduled:
        return self.cache(func, lambda: self._schedule(func))

    def _schedule(self, func) -> schedule.Scheduled:
        done = self._tuned(func) if self.database is not None else None
        if not isinstance(done, schedule.Scheduled):
            why = done
            done = self._default(func)
            self.failures += done.failures
            if self.database is not None:    # say where each schedule came from (the report reads it)
                out = done.func.with_attr(SOURCE_ATTR, f"default: {done.rule}")
                done = dataclasses.replace(done, func=out.with_attr(NOTE_ATTR, why) if why else out)
        # the form the report checks against what a GPU has timed
        form = schedule.form_of(done.rule, self.block_size, done.func) if done.rule != "database" else f"database@{self.block_size}"
        return dataclasses.replace(done, func=done.func.with_attr(FORM_ATTR, form))

    def _default(self, func) -> schedule.Scheduled:
        return default_schedule(func, self.target, self.block_size, self.gemm_k_tile, self.gemm_tile)

    def _tuned(self, func) -> schedule.Scheduled | str | None:
        """The database's schedule of ``func``, or why its record cannot be used (None: no record)."""
        tuned, why = lookup(self.database, func, self.target)
        if tuned is None:
            return why
        if self.block_size is not None and is_cuda(self.target):
            # A stitched kernel has ONE block size: a tuned stage with other thread counts (or
            # virtual threads) would be refused by the stitcher, so the default rules keep it.
            bad = lower.why_not_stitchable(tuned, self.target, self.block_size)
            if bad is not None:
                return f"tuned schedule not used: {bad}"
        out = tuned.with_attr("tirx.is_scheduled", True).with_attr(SOURCE_ATTR, "database")
        return schedule.Scheduled(out, "database")

    def why_not_fused(self, group: Group, outputs: list, readers: dict | None = None) -> str | None:
        """None when the group schedules as well as its anchor does alone; else why not.
        ``readers`` (op -> the ops that read it): also why not where fusing took the anchor's
        parallelism away and the latency model predicts the group slower as one kernel than
        without its last member (``slower_fused``)."""
        func, _ = self.group_funcs(group, outputs)
        try:
            done = self(func)
        except ScheduleError as err:
            return str(err)
        broken = breaks_join(group, done)
        if broken is not None:
            return broken
        anchor = group.anchor
        if anchor is None or len(group.members) == 1:
            return None
        alone, _ = self.group_funcs(Group([anchor]), [anchor])
        try:
            anchor_done = self(alone)
        except ScheduleError:
            return None
        anchor_rule = anchor_done.rule
        if schedule.RANK[done.rule] < schedule.RANK[anchor_rule]:
            # why the anchor's rule did not take the fused group, when it said so
            why = [n for n in done.notes if n.rule == anchor_rule]
            because = f" ({why[0]})" if why else ""
            return f"fused, dlight schedules it with {done.rule}{because}; the anchor alone gets {anchor_rule}"
        if readers is not None and is_cuda(self.target) and \
                block_count(done.func) < block_count(anchor_done.func):
            return self.slower_fused(group, func, readers)
        return None

    def slower_fused(self, group: Group, func: tirx.PrimFunc, readers: dict) -> str | None:
        """Why ``group`` (its PrimFunc ``func``) is predicted slower as one kernel than as the
        groups it would be without the rule that joined it (``kernels.parts_of``: all but its
        last member and that member; a row chain's three; a prologue or a window chain cut where
        it joined), each a kernel of its own in a CUDA graph (an
        estimate); None where it is not, or a form cannot be priced."""
        split = kernels.parts_of(group)
        whole = self._alone_seconds(func)
        parts = [self._alone_seconds(self.group_funcs(g, outputs_of(g, readers))[0]) for g in split]
        if whole is None or None in parts or whole <= sum(parts):
            return None
        return (f"fused, the latency model predicts one kernel slower: {whole * 1e6:.1f} us, against "
                f"{sum(parts) * 1e6:.1f} us as {' then '.join(g.name for g in split)} (its parallelism: "
                f"{block_count(self(func).func)} blocks; estimates)")

    def _alone_seconds(self, func: tirx.PrimFunc) -> float | None:
        """Predicted time of ``func`` scheduled here, each launch region a kernel of its own."""
        try:
            scheduled = self(func).func
            lowered = lower.lower_stage("g", scheduled, self.target)
        except (ScheduleError, StitchError):
            return None
        gpu = hardware.for_arch(str(self.target.attrs.get("arch", "sm_90")))
        return by_time.alone_seconds(gpu, latency.FITTED, _work(scheduled, lowered, func, self.target),
                                     [estimate.stage(low.body) for low in lowered])


def breaks_join(group: Group, done: schedule.Scheduled) -> str | None:
    """Why ``done`` does not build ``group`` as the join that formed it, None where it does: a
    window chain is one ``WindowChain`` kernel (as dlight's Fallback, say, its tile would go
    through global memory, with per-term loads the latency model misses: 9x the L1 sectors)."""
    if group.window_at and done.rule != "WindowChain":
        return f"fused, {done.rule} schedules it: not the window chain's one kernel"
    return None


def held_whole(prog) -> dict:
    """op -> why its rows stay whole: the row reductions of the program's row chains
    (``te.chains``), which the chain's kernel reduces on chip instead of in two phases."""
    return {m.op: f"its rows are held whole on chip ({chain.describe()})"
            for chain in chains.row_chains(prog.stages(), readers_of(prog))
            for m in chain.stages[1:-1] if m.op.reduce_axis}


_TILES: dict = {}    # memo across compiles: structural hash of a GEMM's group PrimFunc -> answer


def gemm_tile(gemm: te.Tensor, side: int | None = None) -> tuple[int, int] | None:
    """The output tile (rows, columns) one block of ``gemm``'s stitched schedule writes, or
    None when it has no such tile a two-phase partial could share: each stitched GEMM rule sizes
    it to the stitched grid (``Matmul``: a square 64, 32 or 16 wide, 16x16 threads;
    ``TensorCoreMatmul``, fp16: 32 x 64 to 64 x 128) and says which on the schedule
    (``GEMM_TILE_ATTR``). Decided for CUDA, whatever the target, so the CPU twin runs the same
    program. ``side``: the SIMT tile side the options fix (``Options.gemm_tile``).
    The stitcher still proves each partial block-local (else it
    keeps a grid sync): this answer only says where a proof can succeed."""
    func, _ = emit.group_primfunc(Group([gemm]), [gemm])
    key = (tvm_ffi.structural_hash(func), side)
    if key not in _TILES:
        _TILES[key] = _tile_of(func, make_target("cuda"), side)
    return _TILES[key]


def _tile_of(func: tirx.PrimFunc, target, side: int | None) -> tuple[int, int] | None:
    try:
        done = default_schedule(func, target, STITCH_BLOCK, gemm_tile=side)
        stages = lower.lower_stage("gemm", done.func, target) if done.rule in _TILE_RULES else []
    except (ScheduleError, StitchError):
        return None
    # one launch region, its threads the rule's own (not, e.g., a tuned variant's)
    if len(stages) != 1 or _thread_count(stages[0]) != _TILE_RULES[done.rule] or GEMM_TILE_ATTR not in done.func.attrs:
        return None
    rows, cols = (int(e) for e in done.func.attrs[GEMM_TILE_ATTR])
    return rows, cols


def _thread_count(stage) -> int:
    return math.prod(e for _, e in stage.threads.values())


# the stitched GEMM rules whose blocks write one dense output tile each, and their threads
_TILE_RULES = {"Matmul": StitchedMatmul().threads, "TensorCoreMatmul": TensorCoreMatmul().threads}


def split_pays(candidate: Candidate, gpu: hardware.GPU | None = None,
               constants: latency.Constants = latency.FITTED) -> str | None:
    """None when the latency model predicts ``candidate`` faster split in two; else why it is kept,
    with both figures (an estimate).

    Both forms have the grid sync after the GEMM (before the combine, or before the row
    reduction), so they differ in two stages: split, the partials run in the GEMM's blocks
    (one tile each, ``lanes`` threads a tile row, their sums added on chip: a partial a tile
    row) and a combine reduces them,
    a row per block; whole, one row reduction per block reads the rows. Both run on a stitched
    kernel's resident blocks (256 threads, grid-stride). The split's first stage is priced as
    if it read the tile from global memory (an upper bound: stitched with its GEMM it reads the
    tile on chip)."""
    gpu = gpu or hardware.for_arch(str(make_target("cuda").attrs["arch"]))
    c = candidate
    tile_rows, tiles_a_row = c.tile[0], c.length // c.tile[1]
    parts = tiles_a_row
    row_bytes = c.rows * c.length * c.elem_bytes
    partial_bytes = c.partials * c.rows * parts * c.partial_bytes
    whole = [Stage(c.rows, STITCH_BLOCK, row_bytes + c.rows * c.partial_bytes, c.partials * c.rows * c.length)]
    split = [Stage(c.rows // tile_rows * tiles_a_row, tile_rows * c.lanes, row_bytes + partial_bytes,
                           c.partials * c.rows * c.length),
             Stage(c.rows, STITCH_BLOCK, partial_bytes + c.rows * c.partial_bytes, c.partials * c.rows * parts)]
    slots = gpu.sms * max(1, gpu.threads_per_sm // STITCH_BLOCK)

    def us(stages):
        return sum(latency.stage_time(gpu, constants, st, slots, persistent=True).seconds for st in stages) * 1e6
    whole_us, split_us = us(whole), us(split)
    if split_us < whole_us:
        return None
    return (f"the latency model predicts the split slower: {split_us:.1f} us for partials in the GEMM's "
            f"{split[0].tiles} tiles and a combine, {whole_us:.1f} us as one row reduction (estimate)")


def is_call_tir(value) -> bool:
    """A group's call (opaque ops' own ``call_tir`` s are not groups)."""
    return emit.is_group_call(value)


class GroupCalls:
    """Where each group of a partition is called in an emitted module's ``main``."""

    def __init__(self, mod: tvm.IRModule, groups: list[Group]):
        self.mod, self.groups = mod, groups
        self.call_index: dict[int, int] = {}      # group position -> position among main's call_tir
        for i, g in enumerate(groups):
            if g.opaque is None:
                self.call_index[i] = len(self.call_index)
        self.bindings = [b for blk in mod["main"].body.blocks for b in blk.bindings]
        self.calls = [b.value for b in self.bindings if is_call_tir(b.value)]

    def func(self, i: int) -> tirx.PrimFunc:
        return self.mod[self.calls[self.call_index[i]].args[0]]

    def subprogram_calls(self, subprograms: list[tuple[list[int], str]]) -> list[list[int]]:
        """Each subprogram's groups as positions among main's calls (opaque groups have none)."""
        return [[self.call_index[i] for i in idx if i in self.call_index] for idx, _ in subprograms]


def group_facts(calls: GroupCalls, target: tvm.target.Target, block: int = STITCH_BLOCK,
                sizes: bool = True, unscheduled: tvm.IRModule | None = None,
                only: set[int] | None = None) -> GroupFacts:
    """What the subprogram partitioner needs to know of every group (``sizes=False``: only
    whether it can be stitched, all the "blocks" partitioner reads). ``unscheduled``: the same
    groups before scheduling, whose flops and footprints the latency model reads (as the
    report does; a schedule's extra blocks would count work twice). ``only``: the facts of these
    groups alone (the others as if opaque), for a subprogram scheduled again at another block."""
    raw = GroupCalls(unscheduled, calls.groups) if unscheduled is not None else None
    groups = calls.groups
    asked = [g.opaque is None and (only is None or i in only) for i, g in enumerate(groups)]
    unstitchable = [lower.why_not_stitchable(calls.func(i), target, block) if asked[i] else None
                    for i in range(len(groups))]
    if not sizes:
        return GroupFacts(unstitchable)
    arch = str(target.attrs["arch"]) if "arch" in target.attrs else str(target.kind.name)
    seen: dict = {}      # (function, unscheduled function) -> facts: repeated blocks share one PrimFunc

    def facts_of(func: tirx.PrimFunc, unscheduled_func: tirx.PrimFunc) -> tuple:
        if (func, unscheduled_func) not in seen:
            lowered = lower.lower_stage("g", func, target)
            count = [0]
            for st in lowered:
                tvm_ffi.structural_walk(st.body, (tirx.Stmt, lambda _: count.__setitem__(0, count[0] + 1)))
            key = (measured.kernel_key(func, arch, lowered[0].num_blocks, lowered[0].num_threads)
                   if len(lowered) == 1 else None)
            plain = _uncounted(func, lowered, unscheduled_func)     # one footprint walk for both views
            seen[(func, unscheduled_func)] = (count[0], [estimate.stage(st.body) for st in lowered],
                                              _counted(plain, func, lowered, target, block), key, lowered,
                                              _counted(plain, func, lowered, target, None))
        return seen[(func, unscheduled_func)]

    statements, stages, work, keys, lowered, alone = [], [], [], [], [], []
    for i, g in enumerate(groups):
        if not asked[i] or unstitchable[i] is not None:
            facts = (0, [], [], None, None, [])
        else:
            facts = facts_of(calls.func(i), raw.func(i) if raw is not None else calls.func(i))
        for column, value in zip((statements, stages, work, keys, lowered, alone), facts):
            column.append(value)
    signature = [tvm_ffi.structural_hash(calls.func(i)) if asked[i] else None for i in range(len(groups))]
    repeats = _repeats(calls) if only is None else [None] * len(groups)
    # at another block size too (``only``): a window priced there without them pays grid syncs the
    # stitcher would not put, and reads off chip what it would keep on it
    onchip, local = (onchip_credit.credits(calls, target, block, hardware.for_arch(arch), lowered, unscheduled)
                     if is_cuda(target) else ([], []))
    return GroupFacts(unstitchable, statements, stages, signature, repeats, work, keys, onchip, alone, local)


def _work(func: tirx.PrimFunc, lowered: list, unscheduled: tirx.PrimFunc, target, block: int | None = None
          ) -> list[Stage]:
    """The latency model's view of a group's lowered stages: the unscheduled function's
    footprint and flops (as the report counts them), the scheduled one's launch geometry, and
    what a block of each stage executes (``_counted``)."""
    return _counted(_uncounted(func, lowered, unscheduled), func, lowered, target, block)


def _uncounted(func: tirx.PrimFunc, lowered: list, unscheduled: tirx.PrimFunc) -> list[Stage]:
    nbytes = sum(tir_stats.block_footprints(unscheduled).values()) or tir_stats.primfunc_param_bytes(unscheduled)
    return tir_stats.work_stages(func, [(st.num_blocks, st.num_threads) for st in lowered], nbytes,
                                 sum(tir_stats.block_flops(unscheduled).values()))


def _counted(stages: list[Stage], func: tirx.PrimFunc, lowered: list, target,
             block: int | None) -> list[Stage]:
    """``stages`` with what a block of each executes (``cost.tir_counts``): its K-loop steps,
    shared wavefronts and global sectors, which a small GEMV's (or a lane-per-row fallback's)
    time rests on more than its bytes. Counted in the
    form it is built in: as a kernel of its own (``block`` None), or as a stage of a
    ``block``-thread stitched kernel. The two differ: TVM's ThreadSync guards dlight's
    column-reduction K loop with a barrier each step in the first, not in the second (one flat
    thread index)."""
    if not is_cuda(target):
        return stages
    counts = _COUNTS(func, lambda: _counts(func, lowered, target, block), key=(str(target), block))
    if len(counts) != len(stages):
        return stages
    return [dataclasses.replace(w, k_steps=c.k_steps, shared_wavefronts=c.shared_wavefronts, sectors=c.global_sectors)
            for w, c in zip(stages, counts)]


# What a block of each stage of a scheduled group executes, built alone (block None) or stitched
# at a block size, across compiles in one process (the zoo's repeated layers and models) and, on
# disk, across processes (``_stored_counts``).
_COUNTS = ByStructure()
# what the counts depend on besides the function: the counting, the one-stage stitch, the build
_COUNTED_BY = [tir_counts, kernel, executable]


def _counts(func: tirx.PrimFunc, lowered: list, target, block: int | None) -> list:
    path = _stored_counts(func, target, block)
    if path is not None and path.exists():
        try:
            return [BlockCounts.from_dict(d) for d in json.loads(path.read_text())]
        except (ValueError, TypeError, KeyError) as err:
            note_recomputed(path, f"unreadable ({type(err).__name__})")
    if block is None:
        counts = executable.device_counts(func, target)
    else:
        counts = []
        for st in lowered:
            try:
                one = kernel.stitch([st], [list(range(len(st.params)))], st.num_blocks, block, target=target)
            except StitchError:
                return []
            counts += executable.device_counts(one.func, target)
    if path is not None:
        try:
            atomic_write(path, json.dumps([c.as_dict() for c in counts]))
        except OSError:     # a cache that cannot be written only costs the next process the count
            pass
    return counts


@functools.lru_cache(maxsize=1)
def _counting_version() -> str:
    digest = hashlib.sha256(tvm.__version__.encode())
    for module in _COUNTED_BY:
        digest.update(Path(module.__file__).read_bytes())
    return digest.hexdigest()[:16]


def _stored_counts(func: tirx.PrimFunc, target, block: int | None) -> Path | None:
    """Where the counts of ``func`` (built alone, or stitched at ``block``) are kept on disk (None
    where no cache can be written): by its structural hash (stable across processes, as MetaSchedule's database relies on), the
    target, the block size and the counting code's version."""
    key = hashlib.sha256(f"{tvm_ffi.structural_hash(func)}|{target}|{block}|{_counting_version()}".encode())
    try:
        root = ptxas.cache_root() / "counts"
        root.mkdir(parents=True, exist_ok=True)
    except OSError:         # no writable cache: count in this process only
        return None
    return root / f"{key.hexdigest()[:32]}.json"


def _repeats(calls: GroupCalls) -> list[int | None]:
    """``rolling.repeats`` over the groups: each group's code skeleton, and its call's inputs as
    the group (and output) that makes them, or the Relax value itself."""
    group_of_call = {c: i for i, c in calls.call_index.items()}
    maker, n = {}, 0
    for b in calls.bindings:
        if is_call_tir(b.value):
            maker[b.var] = (group_of_call[n], 0)
            n += 1
        elif isinstance(b.value, relax.TupleGetItem) and b.value.tuple_value in maker:
            maker[b.var] = (maker[b.value.tuple_value][0], b.value.index)
    sigs, reads = [], []
    for i, g in enumerate(calls.groups):
        if g.opaque is not None:
            sigs.append(None)
            reads.append([])
            continue
        sigs.append(rolling.skeleton_hash(calls.func(i)))
        reads.append([("group", *maker[a]) if a in maker else ("ext", ExprKey(a))
                      for a in calls.calls[calls.call_index[i]].args[1].fields])
    return rolling.repeats(sigs, reads)


def schedules_alone(mod: tvm.IRModule, unscheduled: tvm.IRModule, groups: list[Group], target: tvm.target.Target,
                    timer: by_time.Timer, gemm_k_tile: int | None = None) -> dict[int, tirx.PrimFunc]:
    """Per group, the schedule v2 gives it (the default rules' block size) where the latency
    model predicts it faster than the stitchable one as a kernel of its own; each such group's
    time is recorded in ``timer.rescheduled``, so the partitioner prices a boundary around it at
    what will be built."""
    calls, raw = GroupCalls(mod, groups), GroupCalls(unscheduled, groups)
    cache = ScheduleCache(target, None, gemm_k_tile)
    out: dict[int, tirx.PrimFunc] = {}
    seconds: dict = {}     # unscheduled function -> (v2 schedule, its time): repeated blocks share one
    for i, g in enumerate(groups):
        if g.opaque is not None or i not in calls.call_index or not timer.facts.work[i]:
            continue
        if raw.func(i) not in seconds:
            v2 = cache(raw.func(i))
            seconds[raw.func(i)] = (v2, _alone_seconds(v2.func, raw.func(i), target, timer))
        v2, alt = seconds[raw.func(i)]
        if breaks_join(g, v2) is None and alt is not None and alt < timer.stitchable_alone(i):
            out[i], timer.rescheduled[i] = v2.func, alt
    return out


def reschedule_alone(mod: tvm.IRModule, groups: list[Group], subprograms: list[tuple[list[int], str]],
                     alone: dict[int, tirx.PrimFunc]) -> tvm.IRModule:
    """Groups left as kernels of their own get their ``alone`` schedule (``schedules_alone``); a
    function that is also a stage of a stitched subprogram keeps its stitchable schedule."""
    calls = GroupCalls(mod, groups)

    def gv_of(i: int):
        return calls.calls[calls.call_index[i]].args[0]

    keep = {gv_of(i).name_hint for idx, _ in subprograms if len(idx) > 1 for i in idx if i in calls.call_index}
    out = tvm.IRModule(dict(mod.functions), attrs=mod.attrs)
    for idx, _ in subprograms:
        if len(idx) == 1 and idx[0] in alone and gv_of(idx[0]).name_hint not in keep:
            out.update_func(gv_of(idx[0]), alone[idx[0]])
    return out


def _alone_seconds(func: tirx.PrimFunc, unscheduled: tirx.PrimFunc, target, timer: by_time.Timer) -> float | None:
    """Predicted time of a scheduled group as kernels of its own under a CUDA graph (static
    resource estimate); None where its launch form cannot be read."""
    try:
        lowered = lower.lower_stage("g", func, target)
    except StitchError:
        return None
    return timer.alone(_work(func, lowered, unscheduled, target), [estimate.stage(low.body) for low in lowered])
