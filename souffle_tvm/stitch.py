"""Stitching: several scheduled stages become ONE cooperative CUDA kernel.

Each stage PrimFunc (scheduled for one shared block size) is lowered through TVM's s_tir
pipeline up to ``LowerOpaqueBlock`` (thread bindings are then ``thread_extent`` attributes,
buffers still multi-dimensional). Its launch is peeled off and its body re-homed in one
launch of ``grid`` blocks × ``block`` threads: each stage walks its own blocks grid-stride
(a bid-dependent trip count, never an ``if`` around barriers), and a ``grid_sync`` separates
a stage from an earlier one whose output it reads. The rest of TVM's pipeline then runs once
on the stitched function (ThreadSync, allreduce lowering, shared-memory merging across
stages, host/device split), and ``AttachCooperativeLaunch`` marks the kernel for a
cooperative launch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import tvm
import tvm_ffi
from tvm import s_tir, tirx

from .errors import SouffleError


class StitchError(SouffleError):
    """The stages cannot be stitched as given (mismatched block sizes, barriers under guards...)."""


def _prefix_passes():
    """TVM's s_tir pipeline up to and including LowerOpaqueBlock (copied from s_tir/pipeline.py)."""
    t = s_tir.transform
    return [t.CanonicalizeLoop(), t.LowerCrossThreadReduction(), t.LowerInitBlock(),
            t.PlanAndUpdateBufferAllocationLocation(), t.ConvertBlocksToOpaque(), t.LiftThreadBinding(),
            t.ManifestSharedMemoryLocalStage(), t.CompactBufferAllocation(), t.LowerAutoCopy(),
            t.UnifyThreadBinding(), t.LowerMatchBuffer(), t.StmtSimplify(), t.InjectPermutedLayout(),
            t.AnnotateIrregularLoop(), t.InjectSoftwarePipeline(), t.TransformMmaBufferLayout(),
            t.LowerOpaqueBlock()]


@dataclass
class LoweredStage:
    name: str
    params: list                 # the stage's buffer parameters (Vars)
    body: tirx.Stmt              # below the launch attributes
    blocks: dict                 # "blockIdx.x" -> (var, extent)
    threads: dict                # "threadIdx.x" -> (var, extent)

    @property
    def num_blocks(self) -> int:
        return math.prod(e for _, e in self.blocks.values())

    @property
    def num_threads(self) -> int:
        return math.prod(e for _, e in self.threads.values())


def lower_stage(name: str, func: tirx.PrimFunc, target: tvm.target.Target) -> LoweredStage:
    mod = tvm.IRModule({name: func.with_attr("global_symbol", name)})
    mod = tirx.transform.BindTarget(target)(mod)
    with target:
        low = tvm.transform.Sequential(_prefix_passes())(mod)[name]
    node, blocks, threads, unit = low.body, {}, {}, {}
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
    return LoweredStage(name, list(low.params), node, blocks, threads)


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


def _cast(expr, like):
    dt = str(like.ty) if hasattr(like, "ty") else str(like.dtype)
    return expr if str(expr.ty) == dt else tirx.Cast(dt, expr)


def _param_access(stage: "LoweredStage") -> tuple[list[bool], list[bool]]:
    """Per parameter (by buffer identity, names can repeat): is it read, is it written."""
    loads, stores = [], []
    tvm_ffi.structural_walk(stage.body, [(tvm.ir.TensorLoad, lambda x: loads.append(x.source)),
                                         (tirx.BufferStore, lambda x: stores.append(x.buffer))])
    read = [any(b.same_as(p) for b in loads) for p in stage.params]
    written = [any(b.same_as(p) for b in stores) for p in stage.params]
    return read, written


def stitch(stages: list[LoweredStage], args: list[list], grid: int, block: int, name: str = "souffle_kernel",
           target: tvm.target.Target | None = None) -> tuple[tirx.PrimFunc, list[bool]]:
    """One PrimFunc running ``stages`` in order on ``grid`` × ``block`` threads.

    ``args[i][j]`` identifies stage i's j-th parameter at the call site (any hashable key);
    stages that share a key share a buffer. Returns the function (parameters in first-use
    order of the keys) and, per stage, whether a grid sync precedes it.
    """
    param_of: dict = {}
    params: list = []
    for st, keys in zip(stages, args):
        for p, k in zip(st.params, keys):
            if k not in param_of:
                param_of[k] = p
                params.append(p)
    bid = tirx.Var("blockIdx_x", "int32")
    tid = tirx.Var("threadIdx_x", "int32")
    seq, syncs, written = [], [], set()
    for i, (st, keys) in enumerate(zip(stages, args)):
        if st.num_threads > block:
            raise StitchError(f"{st.name}: {st.num_threads} threads per block, the kernel has {block}")
        vmap = {p: param_of[k] for p, k in zip(st.params, keys)}
        body = st.body
        read, wrote = _param_access(st)
        # Conservative: any read of a buffer an earlier stage wrote since the last sync.
        needs_sync = any(r and k in written for r, k in zip(read, keys))
        if needs_sync:
            seq.append(tirx.Evaluate(tvm.backend.cuda.op.cuda_grid_sync()))
            written = set()
        syncs.append(needs_sync)
        written |= {k for w, k in zip(wrote, keys) if w}
        if st.num_threads < block and _has_barrier(body):
            raise StitchError(f"{st.name}: uses {st.num_threads} threads and barriers; schedule it for {block}")
        it = tirx.Var(f"it{i}", "int32")
        nblk = st.num_blocks
        vb = it * grid + bid
        order = [st.blocks[t] for t in ("blockIdx.x", "blockIdx.y", "blockIdx.z") if t in st.blocks]
        tord = [st.threads[t] for t in ("threadIdx.x", "threadIdx.y", "threadIdx.z") if t in st.threads]
        for var, val in _decompose(vb, order).items():
            vmap[var] = _cast(val, var)
        for var, val in _decompose(tid, tord).items():
            vmap[var] = _cast(val, var)
        stmt = tvm_ffi.structural_map(body, (tirx.Var, lambda v: vmap.get(v, v)))
        if st.num_threads < block:     # barrier-free stage narrower than the kernel
            stmt = tirx.IfThenElse(tid < st.num_threads, stmt, None)
        trip = tirx.floordiv(nblk - bid + (grid - 1), grid)
        seq.append(tirx.For(it, 0, trip, tirx.ForKind.SERIAL, stmt))
    body = tirx.SeqStmt(seq) if len(seq) > 1 else seq[0]
    body = tirx.AttrStmt(tirx.IterVar(tvm.ir.Range(0, block), tid, 1, "threadIdx.x"), "thread_extent", block, body)
    body = tirx.AttrStmt(tirx.IterVar(tvm.ir.Range(0, grid), bid, 1, "blockIdx.x"), "thread_extent", grid, body)
    attrs = {"global_symbol": name, "tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8}
    if target is not None:
        attrs["target"] = target
    func = tirx.PrimFunc(params, body, attrs=tvm.ir.DictAttrs(attrs))
    return func, syncs


def _has_barrier(stmt) -> bool:
    found = []

    def call(c):
        if getattr(c.op, "name", "") in ("tirx.tvm_storage_sync", "tirx.tvm_thread_allreduce"):
            found.append(c)

    tvm_ffi.structural_walk(stmt, (tvm.ir.Call, call))

    def alloc(a):
        if str(a.buffer.ty.storage_scope).startswith("shared"):
            found.append(a)

    tvm_ffi.structural_walk(stmt, (tirx.AllocBuffer, alloc))
    return bool(found)


def has_grid_sync(func: tirx.PrimFunc) -> bool:
    found = []
    tvm_ffi.structural_walk(func.body, (tvm.ir.Call, lambda c: found.append(c)
                                        if getattr(c.op, "name", "") == "tirx.cuda.grid_sync" else None))
    return bool(found)


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
