"""Stitching: several lowered stages become the body of ONE cooperative CUDA kernel.

``stitch`` re-homes the stages (``lower.lower_stage``) in one launch of ``grid`` blocks ×
``block`` threads: each stage walks its own blocks grid-stride (a bid-dependent trip count,
never an ``if`` around barriers), and before each stage goes the weakest barrier its reads of
earlier stages' outputs need (``dependence``: a ``grid_sync`` unless the index maps prove the
reads block-local, then ``__syncthreads``, or thread-local). Runs of repeated stages become
loops (``rolling``). The rest of TVM's pipeline then runs once on the stitched function
(ThreadSync, allreduce lowering, shared-memory merging across stages, host/device split), and
``build.cooperative.attach_cooperative_launch`` marks the kernel for a cooperative launch.
``module.stitch_module`` does this for the subprograms of a Relax module.
"""

from __future__ import annotations

from typing import Callable, Hashable

import tvm
import tvm_ffi
from tvm import tirx

from . import dependence, rolling
from .kernel_ir import ALLREDUCE, accesses, allreduce_threads, decompose, has_barrier, op_name
from .lower import LoweredStage, wide_thread
from ..core.ir_names import K_OPAQUE, MIN_BLOCKS_ATTR, STAGE_BLOCKS, STAGE_THREADS
from ..errors import StitchError
from ..te.rewrite import cast_like


def stitch(stages: list[LoweredStage], args: list[list], grid: int, block: int, name: str = "souffle_kernel",
           target: tvm.target.Target | None = None, param_keys: list | None = None,
           stackable: Callable[[Hashable], bool] | None = None,
           min_blocks: int | None = None) -> tuple[tirx.PrimFunc, list[bool], list]:
    """One PrimFunc running ``stages`` in order on ``grid`` × ``block`` threads.

    ``args[i][j]`` identifies stage i's j-th parameter at the call site (any hashable key);
    stages that share a key share a buffer. Parameters follow ``param_keys`` (default: first
    use). Before each stage goes the weakest barrier its dependences need (``dependence``):
    a grid sync, a block barrier, or none. With ``stackable`` (which tensors may become slots
    of a stacked buffer: made here, not used after the kernel), runs of repeated stages become
    loops (``rolling``). Returns the function, per stage whether a grid sync precedes it, and
    the stacked buffers (``rolling.Stack``: parameters after those of ``param_keys``, which no
    longer include the keys they stack). ``min_blocks``: the register cap, as the blocks per SM
    nvcc must leave room for (``MIN_BLOCKS_ATTR``; the build turns it into ``__launch_bounds__``).
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
    views = [_on_kernel_params(st, keys, param_of, tid) for st, keys in zip(stages, args)]
    items, syncs = [], []      # (barrier or None, stage loop) per stage
    written: dict = {}     # key -> stages that wrote it since the last grid sync
    read: dict = {}        # key -> stages that read it since the last grid sync
    for i, (st, keys, view) in enumerate(zip(stages, args, views)):
        if st.num_threads > block:
            raise StitchError(f"{st.name}: {st.num_threads} threads per block, the kernel has {block}")
        if st.num_threads < block and has_barrier(st.body):
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
    if min_blocks:
        attrs[MIN_BLOCKS_ATTR] = tirx.const(min_blocks, "int32")
    func = tirx.PrimFunc(params, body, attrs=tvm.ir.DictAttrs(attrs))
    return func, syncs, stacks


def _param_access(stage: LoweredStage) -> tuple[list[bool], list[bool]]:
    """Per parameter (by buffer identity, names can repeat): is it read, is it written."""
    loads, stores = accesses(stage.body)
    read = [any(b.same_as(p) for b in loads) for p in stage.params]
    written = [any(b.same_as(p) for b in stores) for p in stage.params]
    return read, written


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

