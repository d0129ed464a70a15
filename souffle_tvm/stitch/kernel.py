"""Stitching: several scheduled stages become ONE cooperative CUDA kernel.

Each stage PrimFunc (scheduled for one shared block size) is lowered through TVM's s_tir
pipeline up to ``LowerOpaqueBlock`` (thread bindings are then ``thread_extent`` attributes,
buffers still multi-dimensional). Its launch is peeled off and its body re-homed in one
launch of ``grid`` blocks × ``block`` threads: each stage walks its own blocks grid-stride
(a bid-dependent trip count, never an ``if`` around barriers), and before each stage goes the
weakest barrier its reads of earlier stages' outputs need (``dependence``: a ``grid_sync``
unless the index maps prove the reads block-local, then ``__syncthreads``, or thread-local). The rest of TVM's pipeline then runs once
on the stitched function (ThreadSync, allreduce lowering, shared-memory merging across
stages, host/device split), and ``AttachCooperativeLaunch`` marks the kernel for a
cooperative launch.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Callable, Hashable

import tvm
import tvm_ffi
from tvm import s_tir, tirx

from . import dependence
from .dependence import atomic_targets
from ..core.ir_names import K_OPAQUE, PREFETCH, STAGE_BLOCKS, STAGE_THREADS
from ..errors import SouffleError, StitchError
from ..te.rewrite import cast_like


GRID_SYNC = "tirx.cuda.grid_sync"
BLOCK_BARRIERS = ("tirx.tvm_storage_sync", "tirx.tvm_thread_allreduce")
BARRIERS = (GRID_SYNC,) + BLOCK_BARRIERS


def op_name(node) -> str:
    return getattr(node.op, "name", "") if isinstance(node, tvm.ir.Call) else ""


def calls_to(node, names) -> list:
    """The calls in ``node`` to any op in ``names``."""
    found = []
    tvm_ffi.structural_walk(node, (tvm.ir.Call, lambda c: found.append(c) if op_name(c) in names else None))
    return found


def _prefix_passes():
    """TVM's s_tir pipeline up to and including LowerOpaqueBlock (copied from s_tir/pipeline.py)."""
    t = s_tir.transform
    return [t.CanonicalizeLoop(), t.LowerCrossThreadReduction(), t.LowerInitBlock(),
            t.PlanAndUpdateBufferAllocationLocation(), t.ConvertBlocksToOpaque(), t.LiftThreadBinding(),
            t.ManifestSharedMemoryLocalStage(), t.CompactBufferAllocation(), t.LowerAutoCopy(),
            t.UnifyThreadBinding(), t.LowerMatchBuffer(), t.StmtSimplify(), t.InjectPermutedLayout(),
            t.AnnotateIrregularLoop(), t.InjectSoftwarePipeline(), t.TransformMmaBufferLayout(),
            t.LowerOpaqueBlock()]


def launch_form(func: tirx.PrimFunc, target: tvm.target.Target, name: str) -> tirx.PrimFunc:
    """``func`` lowered to just before TVM's thread-sync passes: launch attributes, no blocks
    (the form stages are stitched in, and the emulator reads)."""
    mod = tirx.transform.BindTarget(target)(tvm.IRModule({name: func.with_attr("global_symbol", name)}))
    with target:
        return tvm.transform.Sequential(_prefix_passes())(mod)[name]


def pin_strides(body: tirx.Stmt) -> tirx.Stmt:
    """Allocations whose ``buffer_dim_align`` annotation restates the strides they have now.

    The stitched kernel goes through the same passes again, and CompactBufferAllocation then
    re-derives each buffer's strides from that annotation. Its axes were those of the buffer
    before InjectSoftwarePipeline prepended the pipeline-stage axis, so the second time the
    padding lands on the wrong axis (dlight's (2, 1, 64, 64) tile: strides 4608/72 become
    4104/64) while the offsets already baked into ``tvm_access_ptr`` (wmma loads) keep the old
    ones: the tensor cores would read the wrong rows. Restating the strides keeps them."""
    def pin(a):
        ty = a.buffer.ty
        if "buffer_dim_align" not in a.annotations or not list(ty.strides):
            return a
        shape, st = [int(e) for e in ty.shape], [int(e) for e in ty.strides]
        # stride i = the smallest multiple of st[i] >= shape[i+1] * st[i+1]: st[i] itself
        align = [[-1, i, st[i], 0] for i in range(len(st) - 1) if st[i] != shape[i + 1] * st[i + 1]]
        return tirx.AllocBuffer(a.buffer, {k: (align if k == "buffer_dim_align" else v)
                                           for k, v in a.annotations.items()})
    return tvm_ffi.structural_map(body, (tirx.AllocBuffer, pin))


@dataclass
class LoweredStage:
    name: str
    params: list                 # the stage's buffer parameters (Vars), then its scratch buffers
    body: tirx.Stmt              # below the launch attributes
    blocks: dict                 # "blockIdx.x" -> (var, extent)
    threads: dict                # "threadIdx.x" -> (var, extent)
    scratch: int = 0             # how many trailing params are global scratch (were allocations)

    @property
    def num_blocks(self) -> int:
        return math.prod(e for _, e in self.blocks.values())

    @property
    def num_threads(self) -> int:
        return math.prod(e for _, e in self.threads.values())


def lower_stage(name: str, func: tirx.PrimFunc, target: tvm.target.Target) -> list[LoweredStage]:
    """Lower one scheduled PrimFunc; one LoweredStage per launch region it contains."""
    # Fresh variables per use: a PrimFunc called twice in one subprogram (TVM deduplicates
    # identical stages) must not declare the same buffers twice in the stitched kernel.
    low = launch_form(s_tir.renew_defs(func), target, name)
    low = tirx.PrimFunc(low.params, pin_strides(low.body), attrs=low.attrs)
    top = list(low.body.seq) if isinstance(low.body, tirx.SeqStmt) else [low.body]
    # A multi-kernel stage passes data between its kernels through global allocations; in a
    # stitched kernel they become scratch parameters (global buffers the VM allocates).
    scratch = [x.buffer for x in top if isinstance(x, tirx.AllocBuffer) and
               str(x.buffer.ty.storage_scope) == "global"]
    regions = [x for x in top if not (isinstance(x, tirx.AllocBuffer) and any(x.buffer.same_as(b) for b in scratch))]
    if not all(isinstance(r, tirx.AttrStmt) and r.attr_key == "thread_extent" for r in regions):
        raise StitchError(f"{name}: statements outside its launch regions")
    params = list(low.params) + scratch
    return [dataclasses.replace(_peel(f"{name}.{k}" if len(regions) > 1 else name, params, r), scratch=len(scratch))
            for k, r in enumerate(regions)]


@functools.lru_cache(maxsize=4096)
def why_not_stitchable(func: tirx.PrimFunc, target: tvm.target.Target, block: int) -> str | None:
    """None if ``func``'s launch regions can become stages of a ``block``-thread kernel.

    Cached: the partitioner asks per group and ``stitch_module`` asks again per subprogram.
    """
    try:
        stages = lower_stage("stage", func, target)
    except StitchError as err:
        return str(err)
    for st in stages:
        if st.num_threads > block or (st.num_threads < block and _has_barrier(st.body)):
            return f"its schedule uses {st.num_threads} threads per block, the stitched kernel {block}"
    return None


def _peel(name: str, params: list, node) -> LoweredStage:
    blocks, threads, unit = {}, {}, {}
    while isinstance(node, tirx.AttrStmt) and node.attr_key in ("thread_extent", "virtual_thread"):
        tag = node.node.thread_tag
        ext = int(node.value.value) if hasattr(node.value, "value") else None
        if ext is None:
            raise StitchError(f"{name}: launch extent {node.value} is not static")
        if node.attr_key == "virtual_thread":
            if ext != 1:
                raise StitchError(f"{name}: {ext} virtual threads are not supported in stitched kernels")
            unit[node.node.var] = tirx.const(0, str(node.node.var.ty))
        else:
            (blocks if tag.startswith("blockIdx") else threads)[tag] = (node.node.var, ext)
        node = node.body
    _check_no_more_launches(name, node)
    if unit:   # a virtual thread of extent 1 is index 0
        node = tvm_ffi.structural_map(node, (tirx.Var, lambda v: unit.get(v, v)))
    return LoweredStage(name, params, node, blocks, threads)


def _check_no_more_launches(name, body) -> None:
    nested = []
    tvm_ffi.structural_walk(body, (tirx.AttrStmt, lambda a: nested.append(a)
                                   if a.attr_key in ("thread_extent", "virtual_thread") else None))
    if nested:
        raise StitchError(f"{name}: launch attributes below the stage's top level (several kernels in one stage)")


def _decompose(value, extents: list[tuple]) -> dict:
    """x, y, z coordinates of a linear id over (var, extent) pairs in x-fastest order."""
    out, stride = {}, 1
    for var, ext in extents:
        out[var] = tirx.floormod(tirx.floordiv(value, stride), ext) if stride > 1 else tirx.floormod(value, ext)
        stride *= ext
    return out


def accesses(stmt) -> tuple[list, list]:
    """The buffers ``stmt`` loads, and those it stores to (atomic additions included)."""
    loads, stores = [], []
    tvm_ffi.structural_walk(stmt, [(tvm.ir.TensorLoad, lambda x: loads.append(x.source)),
                                   (tirx.BufferStore, lambda x: stores.append(x.buffer))])
    return loads, stores + atomic_targets(stmt)


def _param_access(stage: "LoweredStage") -> tuple[list[bool], list[bool]]:
    """Per parameter (by buffer identity, names can repeat): is it read, is it written."""
    loads, stores = accesses(stage.body)
    read = [any(b.same_as(p) for b in loads) for p in stage.params]
    written = [any(b.same_as(p) for b in stores) for p in stage.params]
    return read, written




def is_prefetch(stmt) -> bool:
    return isinstance(stmt, tirx.For) and PREFETCH in stmt.annotations


def stitch(stages: list[LoweredStage], args: list[list], grid: int, block: int, name: str = "souffle_kernel",
           target: tvm.target.Target | None = None, param_keys: list | None = None,
           stackable: Callable[[Hashable], bool] | None = None) -> tuple[tirx.PrimFunc, list[bool], list]:
    """One PrimFunc running ``stages`` in order on ``grid`` × ``block`` threads.

    ``args[i][j]`` identifies stage i's j-th parameter at the call site (any hashable key);
    stages that share a key share a buffer. Parameters follow ``param_keys`` (default: first
    use). Before each stage goes the weakest barrier its dependences need (``dependence``):
    a grid sync, a block barrier, or none. With ``stackable`` (which tensors may become slots
    of a stacked buffer: made here, not used after the kernel), runs of repeated stages become
    loops (``rolling``). Returns the function, per stage whether a grid sync precedes it, and
    the stacked buffers (``rolling.Stack``: parameters after those of ``param_keys``, which no
    longer include the keys they stack).
    """
    param_of: dict = {}
    for st, keys in zip(stages, args):
        for p, k in zip(st.params, keys):
            param_of.setdefault(k, p)
    params = [param_of[k] for k in (param_keys if param_keys is not None else param_of)]
    access = [_param_access(st) for st in stages]     # (read, written) per parameter, per stage
    stages, args, access = _fills_first(stages, args, access)
    bid = tirx.Var("blockIdx_x", "int64")
    tid = tirx.Var("threadIdx_x", "int64")
    i64 = lambda v: tirx.const(v, "int64")  # noqa: E731 - one index dtype across all stages
    views = [_vb_form(st, keys, param_of, tid) for st, keys in zip(stages, args)]
    items, syncs = [], []      # (barrier or None, stage loop) per stage
    written: dict = {}     # key -> stages that wrote it since the last grid sync
    read: dict = {}        # key -> stages that read it since the last grid sync
    for i, (st, keys, view) in enumerate(zip(stages, args, views)):
        if st.num_threads > block:
            raise StitchError(f"{st.name}: {st.num_threads} threads per block, the kernel has {block}")
        if st.num_threads < block and _has_barrier(st.body):
            raise StitchError(f"{st.name}: uses {st.num_threads} threads and barriers; schedule it for {block}")
        reads, writes = access[i]
        need, pre = dependence.NONE, None
        for r, w, k in zip(reads, writes, keys):
            if r:
                for j in written.get(k, ()):
                    need = dependence.stronger(need, dependence.barrier_needed(views[j], param_of[k], view, param_of[k]))
            if w and (k in written or k in read):     # write after read/write: kept simple
                need = dependence.GRID
        if need == dependence.GRID:
            pre = tirx.Evaluate(tvm.backend.cuda.op.cuda_grid_sync())
            written, read = {}, {}
        elif need == dependence.BLOCK:
            pre = dependence.block_barrier()
        syncs.append(need == dependence.GRID)
        for r, w, k in zip(reads, writes, keys):
            if w:
                written.setdefault(k, []).append(i)
            if r:
                read.setdefault(k, []).append(i)
        it = tirx.Var(f"it{i}", "int64")
        stmt = tvm_ffi.structural_map(view.body, (tirx.Var, lambda v, it=it: it * i64(grid) + bid if v.same_as(dependence.VB) else v))
        if st.num_threads < block:     # barrier-free stage narrower than the kernel
            stmt = tirx.IfThenElse(tid < i64(st.num_threads), stmt, None)
        trip = tirx.floordiv(i64(st.num_blocks) - bid + i64(grid - 1), i64(grid))
        # A stage's unroll pragmas hang on its own (now substituted) thread variable: left as
        # is, it is a free variable, and structurally identical kernels (one per transformer
        # layer) or loop iterations would not be recognised as such.
        stmt = tvm_ffi.structural_map(stmt, (tirx.AttrStmt, lambda a: tirx.AttrStmt(tirx.const(0, "int32"), a.attr_key, a.value, a.body)
                                             if a.attr_key.startswith("pragma_") and isinstance(a.node, tirx.Var) else a))
        items.append((pre, tirx.For(it, i64(0), trip, tirx.ForKind.SERIAL, stmt,
                                    annotations={STAGE_BLOCKS: i64(st.num_blocks), STAGE_THREADS: i64(st.num_threads)})))
    stacks: list = []
    if stackable is not None:
        from . import rolling

        seq, stacks = rolling.roll(items, args, [w for _, w in access], param_of, stackable)
        stacked = rolling.stacked_keys(stacks)
        params = [param_of[k] for k in (param_keys if param_keys is not None else param_of)
                  if k not in stacked] + [s.var for s in stacks]
    else:
        seq = [x for pre, stage in items for x in ((pre, stage) if pre is not None else (stage,))]
    body = tirx.SeqStmt(seq) if len(seq) > 1 else seq[0]
    b64, g64 = tirx.const(block, "int64"), tirx.const(grid, "int64")
    body = tirx.AttrStmt(tirx.IterVar(tvm.ir.Range(tirx.const(0, "int64"), b64), tid, 1, "threadIdx.x"),
                         "thread_extent", b64, body)
    body = tirx.AttrStmt(tirx.IterVar(tvm.ir.Range(tirx.const(0, "int64"), g64), bid, 1, "blockIdx.x"),
                         "thread_extent", g64, body)
    attrs = {"global_symbol": name, "tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": K_OPAQUE}
    if target is not None:
        attrs["target"] = target
    func = tirx.PrimFunc(params, body, attrs=tvm.ir.DictAttrs(attrs))
    return func, syncs, stacks


def _fills_first(stages: list, args: list, access: list) -> tuple[list, list, list]:
    """Stages that only fill buffers with constants (the zero fill before an atomic sum) go to
    the kernel's start when no earlier stage touches those buffers: there the grid syncs the
    kernel has anyway order them before their readers, instead of one more sync."""
    order = list(range(len(stages)))
    touched: set = set()
    fills = []
    for i, (st, keys, (reads, writes)) in enumerate(zip(stages, args, access)):
        mine = {k for w, k in zip(writes, keys) if w}
        if not any(reads) and mine and not (mine & touched) and _constant_stores(st.body):
            fills.append(i)
        touched |= {k for r, w, k in zip(reads, writes, keys) if r or w}
    order = fills + [i for i in order if i not in fills]
    return [stages[i] for i in order], [args[i] for i in order], [access[i] for i in order]


def _constant_stores(body) -> bool:
    values = []
    tvm_ffi.structural_walk(body, (tirx.BufferStore, lambda s: values.append(s.value)))
    return bool(values) and all(isinstance(v, (tirx.IntImm, tirx.FloatImm)) for v in values) and not atomic_targets(body)


def _vb_form(st: LoweredStage, keys: list, param_of: dict, tid: tirx.Var) -> dependence.StageView:
    """The stage's body on the kernel's parameters, its block indices through ``dependence.VB``
    and its thread indices through ``tid``."""
    vmap = {p: param_of[k] for p, k in zip(st.params, keys)}
    order = [st.blocks[t] for t in ("blockIdx.x", "blockIdx.y", "blockIdx.z") if t in st.blocks]
    tord = [st.threads[t] for t in ("threadIdx.x", "threadIdx.y", "threadIdx.z") if t in st.threads]
    for var, val in _decompose(dependence.VB, order).items():
        vmap[var] = cast_like(val, var)
    for var, val in _decompose(tid, tord).items():
        vmap[var] = cast_like(val, var)
    body = tvm_ffi.structural_map(st.body, (tirx.Var, lambda v: vmap.get(v, v)))
    return dependence.StageView(body, tid, st.num_blocks, st.num_threads)


def _has_barrier(stmt) -> bool:
    """A block barrier or shared memory (which ThreadSync will guard with barriers)."""
    shared = []
    tvm_ffi.structural_walk(stmt, (tirx.AllocBuffer, lambda a: shared.append(a)
                                   if str(a.buffer.ty.storage_scope).startswith("shared") else None))
    return bool(shared) or bool(calls_to(stmt, BLOCK_BARRIERS))


def has_grid_sync(func: tirx.PrimFunc) -> bool:
    return bool(calls_to(func.body, (GRID_SYNC,)))


@tvm.transform.module_pass(opt_level=0, name="souffle.AttachCooperativeLaunch")
def attach_cooperative_launch(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """Mark device kernels that grid-sync for a cooperative launch (after SplitHostDevice).

    The dynamic-shared-memory tag must stay last: the runtime checks for it there.
    """
    for gv, f in list(mod.functions.items()):
        lp = f.attrs.get("tirx.kernel_launch_params") if isinstance(f, tirx.PrimFunc) and f.attrs else None
        if lp is None or not has_grid_sync(f) or "tirx.use_cooperative_launch" in list(lp):
            continue
        tags = list(lp)
        pos = len(tags) - (1 if tags and tags[-1] == "tirx.use_dyn_shared_memory" else 0)
        tags.insert(pos, "tirx.use_cooperative_launch")
        mod[gv] = f.with_attr("tirx.kernel_launch_params", tags)
    return mod


# -- static safety check ---------------------------------------------------------------------------
@dataclass
class SafetyReport:
    stages: int
    grid_syncs: int
    grid: int
    max_coresident: int | None
    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems


def stage_loops(func: tirx.PrimFunc) -> list:
    """The stitched body's top-level sequence below the launch attributes."""
    node = func.body
    while isinstance(node, tirx.AttrStmt) and node.attr_key == "thread_extent":
        node = node.body
    return list(node.seq) if isinstance(node, tirx.SeqStmt) else [node]


def replace_stages(func: tirx.PrimFunc, seq: list) -> tirx.PrimFunc:
    """``func`` with its top-level stage sequence replaced, launch attributes kept (for planting
    faults: a sync removed, a stage guarded or re-indexed)."""
    node, attrs = func.body, []
    while isinstance(node, tirx.AttrStmt):
        attrs.append(node)
        node = node.body
    body = tirx.SeqStmt(seq) if len(seq) > 1 else seq[0]
    for a in reversed(attrs):
        body = tirx.AttrStmt(a.node, a.attr_key, a.value, body)
    return tirx.PrimFunc(func.params, body, attrs=func.attrs)


def strip_prefetch(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` without its V4 prefetch loops (the emulator's view: they have no semantics)."""
    seq = stage_loops(func)
    kept = [s for s in seq if not is_prefetch(s)]
    return func if len(kept) == len(seq) else replace_stages(func, kept)


def is_grid_sync(stmt) -> bool:
    return isinstance(stmt, tirx.Evaluate) and op_name(stmt.value) == GRID_SYNC


def _launch_vars(func) -> set:
    names = set()
    tvm_ffi.structural_walk(func.body, (tirx.AttrStmt, lambda a: names.add(a.node.var.name)
                                        if a.attr_key == "thread_extent" else None))
    return names


def launch_var(func, tag: str):
    node = func.body
    while isinstance(node, tirx.AttrStmt) and node.attr_key == "thread_extent":
        if node.node.thread_tag == tag:
            return node.node.var, int(node.value)
        node = node.body
    return None, 0


def stage_view(stmt, bid, tid, grid: int) -> dependence.StageView | None:
    """A stitched stage loop back in vb form (None if it is not one the stitcher wrote)."""
    ann = stmt.annotations if isinstance(stmt, tirx.For) else {}
    if STAGE_BLOCKS not in ann or STAGE_THREADS not in ann:
        return None
    threads = int(ann[STAGE_THREADS])
    body = stmt.body
    if isinstance(body, tirx.IfThenElse) and body.else_case is None and \
            tvm_ffi.structural_equal(body.condition, tid < tirx.const(threads, "int64")):
        body = body.then_case
    vb = stmt.loop_var * tirx.const(grid, "int64") + bid
    body = tvm_ffi.structural_map(body, (tirx.Add, lambda e: dependence.VB if tvm_ffi.structural_equal(e, vb) else e))
    return dependence.StageView(body, tid, int(ann[STAGE_BLOCKS]), threads)


def check(func: tirx.PrimFunc, grid: int, max_coresident: int | None) -> SafetyReport:
    """Prove the stitched kernel safe, or say what is wrong.

    1. every stage that reads a buffer an earlier stage wrote has the barrier the dependence
       needs in between: a grid sync unless ``dependence`` proves the reads block-local (then a
       block barrier) or thread-local; a stage that writes a buffer an earlier stage read or
       wrote has a grid sync in between;
    2. no barrier (grid sync, __syncthreads, cross-thread reduction) sits under a condition
       that depends on the thread or block index (some threads would never arrive);
    3. the grid fits the co-resident limit (when it is known).
    """
    from .rolling import unroll

    func = unroll(func)       # a rolled loop is checked as the statements it executes
    problems = []
    bid, launched = launch_var(func, "blockIdx.x")
    tid, _ = launch_var(func, "threadIdx.x")
    written: list = []          # (param, view, block barriers seen when written) since the last grid sync
    touched: list = []          # params read or written since the last grid sync
    stages = syncs = barriers = 0
    for stmt in stage_loops(func):
        if is_grid_sync(stmt):
            syncs += 1
            written, touched = [], []
            continue
        if dependence.is_block_barrier(stmt):
            barriers += 1
            continue
        if is_prefetch(stmt):
            continue
        stages += 1
        view = stage_view(stmt, bid, tid, launched) if bid is not None and tid is not None else None
        loads, stores = accesses(stmt)
        for p, wview, seen in written:
            if not any(b.same_as(p) for b in loads):
                continue
            need = (dependence.barrier_needed(wview, p, view, p) if view is not None and wview is not None
                    else dependence.GRID)
            if need == dependence.GRID:
                problems.append(f"stage {stages} reads {p.name}, written by an earlier stage with no grid sync between")
            elif need == dependence.BLOCK and seen == barriers:
                problems.append(f"stage {stages} reads {p.name}, written by the same block of an earlier stage "
                                "with no block barrier between")
        mine = [p for p in func.params if any(b.same_as(p) for b in stores)]
        for p in mine:       # write after read / write: the stitcher always orders these with a grid sync
            if any(t.same_as(p) for t in touched):
                problems.append(f"stage {stages} writes {p.name}, which an earlier stage uses, with no grid sync between")
        written += [(p, view, barriers) for p in mine]
        touched += mine + [p for p in func.params if any(b.same_as(p) for b in loads)]
    launch = _launch_vars(func)

    def guarded(node):
        cond_vars = set()
        tvm_ffi.structural_walk(node.condition, (tirx.Var, lambda v: cond_vars.add(v.name)))
        if not (cond_vars & launch):
            return
        barriers = [c for branch in (node.then_case, node.else_case) if branch is not None
                    for c in calls_to(branch, BARRIERS)]
        if barriers:
            problems.append(f"barrier {op_name(barriers[0])} under a condition on {sorted(cond_vars & launch)}")

    tvm_ffi.structural_walk(func.body, (tirx.IfThenElse, guarded))
    if max_coresident is not None and grid > max_coresident:
        problems.append(f"grid of {grid} blocks exceeds the {max_coresident} that can be co-resident; "
                        "grid.sync() would deadlock")
    return SafetyReport(stages, syncs, grid, max_coresident, problems)


# -- Relax integration -----------------------------------------------------------------------------
@dataclass
class StitchedKernel:
    name: str
    stages: list[str]
    grid_syncs: int
    grid: int
    safety: SafetyReport | None = None
    max_blocks: int = 0            # the most blocks any stage has: more grid would idle
    function: str = ""             # the PrimFunc it calls: identical kernels (repeated layers) share one
    refused: str | None = None     # why the stages stayed separate kernels (then nothing else is set)
    prefetched_bytes: int = 0      # V4: bytes of inputs prefetched into L2 ahead of the segment reading them


def stitch_module(mod: tvm.IRModule, target: tvm.target.Target, subprograms: list[list[int]], grid: int,
                  block: int = 256, coresident: int | None = None,
                  grids: dict[str, int] | None = None,
                  prefetch_l2: int | None = None,
                  no_prefetch: set | None = None) -> tuple[tvm.IRModule, list[StitchedKernel]]:
    """Replace each subprogram's consecutive ``call_tir`` bindings of ``main`` by ONE call.

    ``subprograms`` lists, per subprogram, the positions of its calls among main's call_tir
    bindings. The stage PrimFuncs must be scheduled with ``block`` threads. Intermediates
    become extra outputs of the stitched call (global buffers the VM allocates).

    Each kernel launches ``grids.get(name, grid)`` blocks, capped at the most blocks any of its
    stages has (more would idle at every grid sync); ``coresident``, when known, is checked
    against it (the pipeline leaves it to the build, which has ptxas' figures).
    ``prefetch_l2`` (V4): the L2 bytes of the GPU; each kernel then prefetches the inputs of
    its next segment into L2 before the grid sync that precedes it (``prefetch``), except the
    kernels named in ``no_prefetch``.
    """
    from tvm import relax

    main = mod["main"]
    bindings = [b for blk in main.body.blocks for b in blk.bindings]
    call_pos = [i for i, b in enumerate(bindings)
                if isinstance(b.value, relax.Call) and getattr(b.value.op, "name", "") == "relax.call_tir"]
    member_of = {}
    for k, sp in enumerate(subprograms):
        if len(sp) > 1:
            for j in sp:
                member_of[call_pos[j]] = k
    kernels: list[StitchedKernel] = []
    # Subprograms that cannot be stitched (a stage with several launches, a non-static grid...)
    # keep their separate kernels; the reason is recorded, never an error.
    refused = {}
    for k, sp in enumerate(subprograms):
        if len(sp) > 1:
            why = next((w for j in sp for w in [why_not_stitchable(mod[bindings[call_pos[j]].value.args[0]],
                                                                   target, block)] if w), None)
            if why is not None:
                refused[k] = why
                kernels.append(StitchedKernel(f"souffle_stitched_{k}", [], 0, 0, refused=why))
    stitched_calls = [bindings[call_pos[j]] for k, sp in enumerate(subprograms)
                      if len(sp) > 1 and k not in refused for j in sp]
    stitched_vars = {b.var for b in stitched_calls}
    stitched_aliases = _aliases(bindings, stitched_calls)
    alias_positions = {i for i, b in enumerate(bindings) if b.var in stitched_aliases and b.var not in stitched_vars}
    uses = _use_counts(bindings, main.body.body)
    ctx = tvm.IRModule({gv: f for gv, f in mod.functions.items() if gv.name_hint != "main"})
    bb = relax.BlockBuilder(ctx)
    with bb.function("main", list(main.params), attrs={k: v for k, v in main.attrs.items() if k != "global_symbol"}):
        with bb.dataflow():
            env: dict = {}
            done = set()
            for i, b in enumerate(bindings):
                if i in member_of and member_of[i] not in refused:
                    k = member_of[i]
                    if k not in done:
                        done.add(k)
                        calls = [bindings[call_pos[j]] for j in subprograms[k]]
                        name = f"souffle_stitched_{k}"
                        aliases = _aliases(bindings, calls)
                        mine = {b.var for b in calls} | set(aliases)
                        inside = _use_counts([b for b in bindings if b.var in mine])
                        used_after = {v for v, n in uses.items() if n > inside.get(v, 0)}
                        kernels.append(_emit_stitched(bb, mod, target, calls, aliases, env,
                                                      (grids or {}).get(name, grid), block, coresident, name,
                                                      None if name in (no_prefetch or ()) else prefetch_l2,
                                                      used_after))
                    continue
                if i in alias_positions:      # a field of a stitched call: already bound by the stitch
                    continue
                env[b.var] = bb.emit(_remap(b.value, env))
            out = bb.emit_output(_remap(main.body.body, env))
        bb.emit_func_output(out)
    return bb.get(), kernels


def _use_counts(bindings, output=None) -> dict:
    """How often each Relax Var is used by ``bindings`` (and ``output``)."""
    from tvm import relax

    counts: dict = {}

    def count(v):
        counts[v] = counts.get(v, 0) + 1

    for node in [b.value for b in bindings] + ([output] if output is not None else []):
        tvm_ffi.structural_walk(node, (relax.Var, count))
    return counts


def _remap(expr, env):
    from tvm import relax

    if isinstance(expr, relax.Var):
        return env.get(expr, expr)
    return tvm_ffi.structural_map(expr, (relax.Var, lambda v: env.get(v, v)))


def _aliases(bindings, calls) -> dict:
    """``v = t[i]`` bindings whose ``t`` is one of ``calls``: v stands for (position, i)."""
    from tvm import relax

    pos = {}
    out = {}
    for p, b in enumerate(calls):
        pos[b.var] = p
        if not isinstance(b.var.ty, relax.TupleType):
            out[b.var] = ("out", p, 0)    # a single-output call stands for its only field
    for b in bindings:
        if isinstance(b.value, relax.TupleGetItem) and b.value.tuple_value in pos:
            out[b.var] = ("out", pos[b.value.tuple_value], b.value.index)
    return out


def _emit_stitched(bb, mod, target, calls, aliases, env, grid, block, coresident, name,
                   prefetch_l2=None, used_after=None) -> StitchedKernel:
    from tvm import relax

    # Keys: a produced tensor is (binding position, field); an input is its Relax expression.
    produced, types = [], []
    stages, args = [], []
    for pos, b in enumerate(calls):
        gv, fargs = b.value.args[0], list(b.value.args[1].fields)
        fields = list(b.var.ty.fields) if isinstance(b.var.ty, relax.TupleType) else [b.var.ty]
        outs = [("out", pos, i) for i in range(len(fields))]
        produced += outs
        types += fields
        ins = [aliases.get(a, a) if isinstance(a, relax.Var) else a for a in fargs]
        lowered = lower_stage(gv.name_hint, mod[gv], target)
        n_scratch = lowered[0].scratch
        scratch = [("scratch", pos, i) for i in range(n_scratch)]
        produced += scratch
        for buf in lowered[0].params[len(lowered[0].params) - n_scratch:]:
            types.append(relax.TensorType([int(d) for d in buf.ty.shape], str(buf.ty.dtype)))
        for st in lowered:
            stages.append(st)
            args.append(ins + outs + scratch)
    inputs = []
    for a in (x for fa in args for x in fa if not isinstance(x, tuple)):
        if not any(a.same_as(x) for x in inputs):
            inputs.append(a)
    keys = [_Key(x) for x in inputs] + produced
    grid = max(1, min(grid, max(st.num_blocks for st in stages)))
    # A tensor may become a slot of a stacked buffer (a loop's per-iteration copy) unless
    # something after the kernel reads it: a scratch buffer, or an output nobody else uses.
    leaves = set()
    for pos, b in enumerate(calls):
        if used_after is None or b.var in used_after:
            leaves.update(k for k in produced if k[0] == "out" and k[1] == pos)
    leaves.update(key for alias, key in aliases.items() if used_after is None or alias in used_after)
    func, syncs, stacks = stitch(stages, [[_Key(x) if not isinstance(x, tuple) else x for x in fa] for fa in args],
                                 grid, block, name=name, target=target, param_keys=keys,
                                 stackable=lambda k: isinstance(k, tuple) and k not in leaves)
    if stacks:
        from .rolling import stacked_keys

        kind = dict(zip(produced, types))
        stacked = stacked_keys(stacks)
        produced = [k for k in produced if k not in stacked] + [("stack", m) for m in range(len(stacks))]
        types = [kind[k] for k in produced[:len(produced) - len(stacks)]] + \
                [relax.TensorType([int(d) for d in st.var.ty.shape], str(st.var.ty.dtype)) for st in stacks]
    safety = check(func, grid, coresident)
    if not safety.ok:
        raise StitchError(f"{name}: unsafe stitched kernel: {'; '.join(safety.problems)}")
    planted = []
    if prefetch_l2:
        from . import prefetch

        func, planted = prefetch.plant(func, prefetch_l2)
    gv = bb.add_func(func.without_attr("global_symbol"), name)
    sinfo = [relax.TensorType([int(d) for d in t.shape], t.dtype) for t in types]
    call = bb.emit(relax.call_tir(gv, [_remap(a, env) for a in inputs], sinfo))
    items = {key: bb.emit(relax.TupleGetItem(call, i)) for i, key in enumerate(produced) if key[0] == "out"}
    for pos, b in enumerate(calls):
        n_out = len(b.var.ty.fields) if isinstance(b.var.ty, relax.TupleType) else 1
        outs = [items[k] for k in produced if k[0] == "out" and k[1] == pos]
        if len(outs) == n_out:        # (a stacked output is used nowhere after the kernel)
            env[b.var] = outs[0] if not isinstance(b.var.ty, relax.TupleType) else bb.emit(relax.Tuple(outs))
        for alias, key in aliases.items():
            if isinstance(key, tuple) and key[1] == pos and key in items:
                env[alias] = items[key]
    return StitchedKernel(name, [s.name for s in stages], sum(syncs), grid, safety,
                          max_blocks=max(st.num_blocks for st in stages), function=gv.name_hint,
                          prefetched_bytes=sum(p.bytes for p in planted))


class _Key:
    """A Relax expression as a dict key (identity; Relax overloads nothing, but be explicit)."""

    def __init__(self, expr):
        self.expr = expr

    def __hash__(self):
        return hash(self.expr)

    def __eq__(self, other):
        return isinstance(other, _Key) and self.expr.same_as(other.expr)
