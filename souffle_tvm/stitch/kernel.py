"""Stitching: several lowered stages become the body of ONE cooperative CUDA kernel.

``stitch`` re-homes the stages (``lower.lower_stage``) in one launch of ``grid`` blocks ×
``block`` threads: each stage walks its own blocks grid-stride (a bid-dependent trip count,
never an ``if`` around barriers), and before each stage goes the weakest barrier its reads of
earlier stages' outputs need (``dependence``: a ``grid_sync`` unless the index maps prove the
reads block-local, then ``__syncthreads``, or thread-local). A block-local intermediate
nobody reads after the kernel stays on chip, in a per-block shared buffer, its producer and
consumers sharing one grid-stride loop (``channel``). Where it takes fewer grid syncs, the
stages run by wave, independent chains side by side on their own blocks (``waves``). Runs of
repeated stages become loops (``rolling``). The rest of TVM's pipeline then runs once on the stitched function
(ThreadSync, allreduce lowering, shared-memory merging across stages, host/device split), and
``build.cooperative.attach_cooperative_launch`` marks the kernel for a cooperative launch.
``module.stitch_module`` does this for the subprograms of a Relax module.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Hashable, NamedTuple

import tvm
import tvm_ffi
from tvm import tirx

from . import channel, dependence, ramps, resident, rolling, waves
from .kernel_ir import ALLREDUCE, accesses, allreduce_threads, decompose, has_barrier, lane_block, op_name
from .lower import LoweredStage, wide_thread
from ..cost import estimate, tir_stats
from ..core.ir_names import FUSED, K_OPAQUE, MIN_BLOCKS_ATTR, STAGE_BLOCKS, STAGE_LANE, STAGE_THREADS
from ..errors import StitchError
from ..partition.subprograms import MAX_GROUPS_PER_SUBPROGRAM
from ..te.rewrite import cast_like


class Stitched(NamedTuple):
    func: tirx.PrimFunc
    syncs: list[bool]              # per stage (in kernel order): is a grid sync before it
    stacks: list                   # the stacked buffers (``rolling.Stack``)
    channels: list                 # the tensors kept on chip (``channel.Channel``)
    order: list[int]               # per stage in kernel order: its index in ``stages`` as given
    residents: list                # the inputs each block keeps a copy of (``resident.Resident``)
    onchip_stacks: list            # ``rolling.Stack``s in shared memory: a rolled run's channels, one per slot
    phases: list[tuple[int, int]]  # per stage in kernel order: (segment between grid syncs, lane) (``_phases``)


def stitch(stages: list[LoweredStage], args: list[list], grid: int, block: int, name: str = "souffle_kernel",
           target: tvm.target.Target | None = None, param_keys: list | None = None,
           stackable: Callable[[Hashable], bool] | None = None,
           min_blocks: int | None = None, private: Callable[[Hashable], bool] | None = None,
           waves_allowed: bool = True) -> Stitched:
    """One PrimFunc running ``stages`` in order on ``grid`` × ``block`` threads.

    ``args[i][j]`` identifies stage i's j-th parameter at the call site (any hashable key);
    stages that share a key share a buffer. Parameters follow ``param_keys`` (default: first
    use). Before each stage goes the weakest barrier its dependences need (``dependence``):
    a grid sync, a block barrier, or none. With ``stackable`` (which tensors may become slots
    of a stacked buffer: made here, not used after the kernel), runs of repeated stages become
    loops (``rolling``). With ``private`` (which tensors are made here and not read after the
    kernel), a block-local one becomes a per-block shared buffer, its producer and consumers
    fused into one grid-stride loop (``channel``), and an input several stages read the same
    box of per block is copied into each block's shared memory once (``resident``). Returns the
    function, per stage whether a grid sync precedes it, the stacked buffers (``rolling.Stack``: parameters after those of
    ``param_keys``, which no longer include the keys they stack) and the channels (whose keys
    are no parameters either, except a ``dual`` one's). ``min_blocks``: the register cap, as the blocks per SM
    nvcc must leave room for (``MIN_BLOCKS_ATTR``; the build turns it into ``__launch_bounds__``).
    """
    given = (stages, args, grid, block)
    param_of: dict = {}
    for st, keys in zip(stages, args):
        for p, k in zip(st.params, keys):
            param_of.setdefault(k, p)
    access = [_param_access(st) for st in stages]     # (read, written) per parameter, per stage
    order = _fills_first(stages, args, access)
    stages, args, access = [stages[i] for i in order], [args[i] for i in order], [access[i] for i in order]
    bid = tirx.Var("blockIdx_x", "int64")
    tid = tirx.Var("threadIdx_x", "int64")
    views = [_on_kernel_params(st, keys, param_of, tid) for st, keys in zip(stages, args)]
    needs = _barriers(stages, args, access, views, param_of, block)
    waved = _by_waves(stages, args, access, views, param_of, block, grid, needs) if waves_allowed else None
    if waved is not None:
        moved, needs, views = waved
        order = [order[i] for i in moved]
        stages, args, access = [stages[i] for i in moved], [args[i] for i in moved], [access[i] for i in moved]
    own_shared = [estimate.stage(v.body).shared_bytes for v in views] if private is not None else []
    # inputs re-read by several stages first (an LSTM layer's weights: a copy spares a read per
    # step), then the produced tensors in what shared memory is left
    residents, views = (resident.plan(views, args, access, needs, param_of, own_shared, grid, block)
                        if private is not None else ([], views))
    copies = resident.copies(residents)
    for r in residents:     # a later reader sees the fill behind a barrier of its own (what the check proves)
        for i in r.readers[1:]:
            needs[i] = dependence.stronger(needs[i], dependence.BLOCK)
    channels, spans, views = (channel.plan(views, args, access, needs, param_of, private, own_shared, grid,
                                           sum(tir_stats.buffer_bytes(b) for b in copies), block, waved is not None)
                              if private is not None else ([], [], views))
    gone = {ch.key for ch in channels if not ch.dual}
    # a resident channel's copies, one per iteration of a repeated run, stack like global tensors
    # (an LSTM's cell state c, step after step on one block): rolling sees their buffers as keys
    onchip = {onchip_key(ch): ch for ch in channels if ch.resident}
    onchip_of = [{ch.key: k for k, ch in onchip.items() if j in [ch.writer] + ch.readers} for j in range(len(stages))]
    resident_reads = [any(ch.resident and i in ch.readers for ch in channels) or any(i in r.readers for r in residents)
                      for i in range(len(stages))]
    syncs = [need == dependence.GRID for need in needs]
    pres = [tirx.Evaluate(tvm.backend.cuda.op.cuda_grid_sync()) if need == dependence.GRID
            else dependence.block_barrier() if need == dependence.BLOCK else None for need in needs]
    items, item_keys, item_writes = [], [], []
    first = {a: b for a, b in spans}
    i = 0
    while i < len(stages):
        last = first.get(i, i)
        it = tirx.Var(f"it{i}", "int64")
        rb = lane_block(bid, views[i].lane, grid)      # a fused span's stages share a lane (``channel``)
        parts = [_stage_body(stages[j], views[j], it, grid, block, tid, bid) for j in range(i, last + 1)]
        if needs[i] == dependence.GRID and resident_reads[i]:
            # TVM's ThreadSync does not know that a grid sync orders shared memory too: a block
            # barrier of its own before a stage that reads a resident channel after one
            parts[0] = tirx.SeqStmt([dependence.block_barrier(), parts[0]])
        if last == i:
            loop = tirx.For(it, _i64(0), _trip(stages[i].num_blocks, grid, rb), tirx.ForKind.SERIAL, parts[0],
                            annotations=_stage_annotations(stages[i], views[i].lane))
        else:
            loop = _fused(it, stages[i:last + 1], pres[i + 1:last + 1], parts,
                          [ch.buffer for ch in channels if not ch.resident and i <= ch.writer <= last], grid, rb,
                          views[i].lane)
        items.append((pres[i], loop))
        kept = [(key, w) for j in range(i, last + 1) for k, w in zip(args[j], access[j][1])
                for key in ([k] if k not in gone else []) + ([onchip_of[j][k]] if k in onchip_of[j] else [])]
        item_keys.append([k for k, _ in kept])
        item_writes.append([w for _, w in kept])
        i = last + 1
    keys = [k for k in (param_keys if param_keys is not None else param_of) if k not in gone]
    params = [param_of[k] for k in keys]
    stacks: list = []
    onchip_stacks: list = []
    if stackable is not None:
        # a wave kernel's first and last waves join its steady waves' loop under guards (``ramps``)
        seq, stacks = (ramps.roll if waved is not None else rolling.roll)(
            items, item_keys, item_writes, {**param_of, **{k: ch.buffer for k, ch in onchip.items()}},
            lambda k: k in onchip or stackable(k))
        stacked = rolling.stacked_keys(stacks)
        onchip_stacks = [s for s in stacks if any(k in onchip for k in s.keys)]
        stacks = [s for s in stacks if s not in onchip_stacks]
        params = [param_of[k] for k in keys if k not in stacked] + [s.var for s in stacks]
        onchip = {k: ch for k, ch in onchip.items() if k not in stacked}
    else:
        seq = [x for pre, stage in items for x in ((pre, stage) if pre is not None else (stage,))]
    # resident channels (or their stacks) and inputs' copies: one per block for the whole kernel,
    # across its grid syncs
    alive = [ch.buffer for ch in onchip.values()] + [s.var for s in onchip_stacks]
    seq = [tirx.AllocBuffer(b) for b in alive + copies] + seq
    body = tirx.SeqStmt(seq) if len(seq) > 1 else seq[0]
    b64, g64 = tirx.const(block, "int64"), tirx.const(grid, "int64")
    body = tirx.AttrStmt(tirx.IterVar(tvm.ir.Range(tirx.const(0, "int64"), b64), tid, 1, "threadIdx.x"),
                         "thread_extent", b64, body)
    body = tirx.AttrStmt(tirx.IterVar(tvm.ir.Range(tirx.const(0, "int64"), g64), bid, 1, "blockIdx.x"),
                         "thread_extent", g64, body)
    attrs = {"global_symbol": name, "tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": K_OPAQUE}
    if target is not None:
        attrs["target"] = target
    if min_blocks:
        attrs[MIN_BLOCKS_ATTR] = tirx.const(min_blocks, "int32")
    func = tirx.PrimFunc(params, body, attrs=tvm.ir.DictAttrs(attrs))
    if waved is not None and written_out(func) > MAX_GROUPS_PER_SUBPROGRAM:
        # more code than the partitioner sizes any kernel for, which TVM's passes may not survive:
        # the full 10 x 100 LSTM's wave kernel crashed its build written out (3861 stages) and
        # rolled with guarded ramps (3880 stages, 109 top-level loops, a segfault after 18
        # minutes); the given order
        return stitch(*given, name=name, target=target, param_keys=param_keys, stackable=stackable,
                      min_blocks=min_blocks, private=private, waves_allowed=False)
    return Stitched(func, syncs, stacks, channels, order, residents, onchip_stacks,
                    _phases(needs, [v.lane for v in views], [st.num_blocks for st in stages], grid))


def onchip_key(ch: channel.Channel) -> Hashable:
    """The key a channel's buffer goes by when runs are rolled: the tensor's own, unless the
    tensor also stays a parameter (a ``dual`` channel's writer stores both)."""
    return ("onchip", ch.key) if ch.dual else ch.key


def _by_waves(stages: list, args: list, access: list, views: list, param_of: dict, block: int, grid: int,
              needs: list[str]) -> tuple[list[int], list[str], list] | None:
    """The stages by wave, each on its lane (``waves``): (the new order, its barriers, its views),
    where that order needs fewer grid syncs than ``needs``; None where it does not."""
    def crosses(j: int, i: int, key) -> bool:      # on one lane: does i read what another block of j wrote
        return dependence.barrier_needed(views[j], param_of[key], views[i], param_of[key]) == dependence.GRID

    plan = waves.schedule(args, access, [st.num_blocks for st in stages], grid, crosses)
    if plan.order == list(range(len(stages))) and not any(plan.lanes):
        return None
    moved = [dataclasses.replace(views[i], lane=lane) for i, lane in zip(plan.order, plan.lanes)]
    waved = _barriers([stages[i] for i in plan.order], [args[i] for i in plan.order],
                      [access[i] for i in plan.order], moved, param_of, block)
    if waved.count(dependence.GRID) >= needs.count(dependence.GRID):
        return None
    return plan.order, waved, moved


def written_out(func: tirx.PrimFunc) -> int:
    """Stage loops a stitched kernel's body writes out: a rolled loop's stages once, a fused
    loop's each (the code TVM's passes and nvcc compile grows with them)."""
    count = [0]
    tvm_ffi.structural_walk(func.body, (tirx.For, lambda f: count.__setitem__(0, count[0] + (STAGE_BLOCKS in f.annotations))))
    return count[0]


def _phases(needs: list[str], lanes: list[int], blocks: list[int], grid: int) -> list[tuple[int, int]]:
    """Per stage, ``(segment, lane)``: the segment between grid syncs it runs in, and its lane
    there. In a segment the stages of one lane run one after another and the lanes at once, on
    disjoint blocks (``waves``); a segment whose lanes' blocks overlap or wrap around the grid
    runs as one lane (0)."""
    segments, at = [], -1
    for need in needs:
        at += need == dependence.GRID or at < 0
        segments.append(at)
    out = []
    for seg in sorted(set(segments)):
        members = [i for i, s in enumerate(segments) if s == seg]
        spans = {}
        for i in members:
            spans[lanes[i]] = max(spans.get(lanes[i], 0), blocks[i])
        ranges = sorted(spans.items())
        disjoint = all(a + w <= b for (a, w), (b, _) in zip(ranges, ranges[1:])) and ranges[-1][0] + ranges[-1][1] <= grid
        out += [(seg, lanes[i] if disjoint else 0) for i in members]
    return out


def _barriers(stages: list, args: list, access: list, views: list, param_of: dict, block: int) -> list[str]:
    """Per stage, the weakest barrier its dependences on earlier stages need (``dependence``)."""
    needs = []
    written: dict = {}     # key -> stages that wrote it since the last grid sync
    read: dict = {}        # key -> stages that read it since the last grid sync
    for i, (st, keys, view) in enumerate(zip(stages, args, views)):
        if st.num_threads > block:
            raise StitchError(f"{st.name}: {st.num_threads} threads per block, the kernel has {block}")
        if st.num_threads < block and has_barrier(st.body):
            raise StitchError(f"{st.name}: uses {st.num_threads} threads and barriers; schedule it for {block}")
        reads, writes = access[i]
        need = dependence.NONE
        for r, w, k in zip(reads, writes, keys):
            if r:
                for j in written.get(k, ()):
                    need = dependence.stronger(need, dependence.barrier_needed(views[j], param_of[k], view, param_of[k]))
            if w and (k in written or k in read):     # write after read/write: kept simple
                need = dependence.GRID
        if need == dependence.GRID:
            written, read = {}, {}
        needs.append(need)
        for r, w, k in zip(reads, writes, keys):
            if w:
                written.setdefault(k, []).append(i)
            if r:
                read.setdefault(k, []).append(i)
    return needs


def _i64(v: int) -> tirx.PrimExpr:
    return tirx.const(v, "int64")     # one index dtype across all stages


def _stage_body(st: LoweredStage, view: dependence.StageView, it, grid: int, block: int, tid, bid) -> tirx.Stmt:
    """One stage's block body at virtual block ``it * grid + bid`` of the kernel's launch (``bid``
    rotated to the stage's lane)."""
    vb = it * _i64(grid) + lane_block(bid, view.lane, grid)
    stmt = tvm_ffi.structural_map(view.body, (tirx.Var, lambda v: vb if v.same_as(dependence.VB) else v))
    if st.num_threads < block:     # barrier-free stage narrower than the kernel
        stmt = tirx.IfThenElse(tid < _i64(st.num_threads), stmt, None)
    # A stage's unroll pragmas hang on its own (now substituted) thread variable: left as
    # is, it is a free variable, and structurally identical kernels (one per transformer
    # layer) or loop iterations would not be recognised as such.
    return tvm_ffi.structural_map(stmt, (tirx.AttrStmt, lambda a: tirx.AttrStmt(tirx.const(0, "int32"), a.attr_key, a.value, a.body)
                                         if a.attr_key.startswith("pragma_") and isinstance(a.node, tirx.Var) else a))


def _trip(blocks: int, grid: int, bid) -> tirx.PrimExpr:
    """Block ``bid``'s share of ``blocks`` virtual blocks walked grid-stride: a bid-dependent trip
    count, never an ``if`` around barriers."""
    return tirx.floordiv(_i64(blocks) - bid + _i64(grid - 1), _i64(grid))


def _stage_annotations(st: LoweredStage, lane: int = 0) -> dict:
    """What marks a stage's loop as one: its own block and thread counts (and its lane)."""
    return {STAGE_BLOCKS: _i64(st.num_blocks), STAGE_THREADS: _i64(st.num_threads),
            **({STAGE_LANE: _i64(lane)} if lane else {})}


def _fused(it, stages: list, pres: list, parts: list, buffers: list, grid: int, bid, lane: int = 0) -> tirx.For:
    """Several stages in ONE grid-stride loop over their (common) virtual blocks, each iteration
    every stage in order with its barrier before it, the channels' shared buffers allocated per
    iteration; a block barrier ends an iteration when there can be a next one, which overwrites
    the channels (``channel``). Each stage is a one-trip loop carrying its stage annotations,
    so the check, the emulator and the traffic counter still see its stages."""
    blocks = stages[0].num_blocks
    seq: list = [tirx.AllocBuffer(b) for b in buffers]
    for k, (st, pre, part) in enumerate(zip(stages, [None] + list(pres), parts)):
        if pre is not None:
            seq.append(pre)
        seq.append(tirx.For(tirx.Var(f"{it.name}_{k}", "int64"), _i64(0), _i64(1), tirx.ForKind.SERIAL, part,
                            annotations=_stage_annotations(st, lane)))
    if blocks > grid:
        seq.append(dependence.block_barrier())
    return tirx.For(it, _i64(0), _trip(blocks, grid, bid), tirx.ForKind.SERIAL, tirx.SeqStmt(seq),
                    annotations={FUSED: _i64(len(stages))})


def _param_access(stage: LoweredStage) -> tuple[list[bool], list[bool]]:
    """Per parameter (by buffer identity, names can repeat): is it read, is it written."""
    loads, stores = accesses(stage.body)
    read = [any(b.same_as(p) for b in loads) for p in stage.params]
    written = [any(b.same_as(p) for b in stores) for p in stage.params]
    return read, written


def _fills_first(stages: list, args: list, access: list) -> list[int]:
    """The stages' order in the kernel: stages that only fill buffers with constants (the zero
    fill before an atomic sum) go to the kernel's start when no earlier stage touches those
    buffers: there the grid syncs the kernel has anyway order them before their readers,
    instead of one more sync."""
    touched: set = set()
    fills = []
    for i, (st, keys, (reads, writes)) in enumerate(zip(stages, args, access)):
        mine = {k for w, k in zip(writes, keys) if w}
        if not any(reads) and mine and not (mine & touched) and _constant_stores(st.body):
            fills.append(i)
        touched |= {k for r, w, k in zip(reads, writes, keys) if r or w}
    return fills + [i for i in range(len(stages)) if i not in fills]


def _constant_stores(body) -> bool:
    values = []
    tvm_ffi.structural_walk(body, (tirx.BufferStore, lambda s: values.append(s.value)))
    return (bool(values) and all(isinstance(v, (tirx.IntImm, tirx.FloatImm)) for v in values)
            and not dependence.atomic_targets(body))


def _on_kernel_params(st: LoweredStage, keys: list, param_of: dict, tid: tirx.Var) -> dependence.StageView:
    """The stage's body on the kernel's parameters, its block indices through ``dependence.VB``
    and its thread indices through ``tid``."""
    vmap = {p: param_of[k] for p, k in zip(st.params, keys)}
    order = [st.blocks[t] for t in ("blockIdx.x", "blockIdx.y", "blockIdx.z") if t in st.blocks]
    tord = [st.threads[t] for t in ("threadIdx.x", "threadIdx.y", "threadIdx.z") if t in st.threads]
    for var, val in decompose(dependence.VB, order).items():
        vmap[var] = cast_like(val, var)
    for var, val in decompose(tid, tord).items():
        vmap[var] = cast_like(val, var)
    body = st.body
    if allreduce_threads(body):
        # TVM lowers a cross-thread reduction only over launch threads: a stage reducing over
        # its one thread index, as wide as the kernel (``lower.why_not_stitchable`` lets no
        # other form through), reduces over the kernel's own threadIdx.x.
        var = wide_thread(st)
        body = tvm_ffi.structural_map(body, (tvm.ir.Call, lambda c: tvm.ir.Call(
            c.op, [tid if a.same_as(var) else a for a in c.args], ret_ty=c.ty) if op_name(c) == ALLREDUCE else c))
    body = tvm_ffi.structural_map(body, (tirx.Var, lambda v: vmap.get(v, v)))
    return dependence.StageView(body, tid, st.num_blocks, st.num_threads)

