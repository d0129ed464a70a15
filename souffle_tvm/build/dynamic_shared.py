"""The TIR build pass that moves a kernel's shared memory to ``shared.dyn`` when its static
``__shared__`` arrays would pass the 48 KB a CUDA kernel may declare statically.

ptxas refuses a kernel whose static shared memory is over 48 KB ("uses too much shared data");
above it a kernel must use dynamic shared memory and opt in to its size. TVM does both for a
``shared.dyn`` buffer: ``MergeSharedMemoryAllocations`` folds them into one
``extern __shared__`` array, SplitHostDevice adds the ``tirx.use_dyn_shared_memory`` launch tag
and the size as a launch argument, and TVM's CUDA runtime calls ``cuFuncSetAttribute(
MAX_DYNAMIC_SHARED_SIZE_BYTES)`` for it at load. So this pass only changes the scope, first in
the TIR pipeline, for any function (a Souffle group, a stitched kernel, TVM's own fused
kernels alike) whose lowered kernel declares more than ``STATIC_SHARED_LIMIT`` statically.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import tirx

from ..cost import tir_stats
from ..core.geometry import STATIC_SHARED_LIMIT
from ..stitch.lower import in_launch_form, launch_form

STATIC = "shared"
DYNAMIC = "shared.dyn"


def _buffers(node, scope: str) -> list:
    """Every buffer Var of ``scope`` that ``node`` allocates (block allocations and AllocBuffer)."""
    found: dict = {}

    def keep(buf) -> None:
        if str(buf.ty.storage_scope) == scope:
            found.setdefault(buf, None)

    def block(b) -> None:
        for x in b.alloc_buffers:
            keep(x)

    tvm_ffi.structural_walk(node, [(tvm.s_tir.SBlock, block), (tirx.AllocBuffer, lambda a: keep(a.buffer))])
    return list(found)


def static_shared_bytes(func: tirx.PrimFunc, target: tvm.target.Target) -> int:
    """The most static shared memory any kernel of ``func`` declares once lowered: the sum of its
    ``shared`` allocations per launch region after StorageRewrite, which reuses them across
    stages as the real build does (a stitched ViT block: 36.9 KB allocated, 6.9 KB declared).
    Where those passes fail on their own (they run here without the rest of TVM's pipeline),
    the allocations' plain sum: an upper bound."""
    if not _buffers(func.body, STATIC):
        return 0
    low = func if in_launch_form(func) else launch_form(func, target, "probe")
    try:
        low = _storage_rewritten(low, target)
    except tvm.error.TVMError:
        pass
    regions = [s for s in _top_level(low.body) if isinstance(s, tirx.AttrStmt)] or [low.body]
    return max(sum(tir_stats.buffer_bytes(b) for b in _buffers(r, STATIC)) for r in regions)


def _storage_rewritten(low: tirx.PrimFunc, target: tvm.target.Target) -> tirx.PrimFunc:
    """A launch-form function through TVM's passes from FlattenBuffer to StorageRewrite (the
    order of ``tvm.s_tir.pipeline``; the ones that cannot change an allocation left out)."""
    mod = tirx.transform.BindTarget(target)(tvm.IRModule({"probe": low.with_attr("global_symbol", "probe")}))
    with target:
        return tvm.transform.Sequential([
            tirx.transform.FlattenBuffer(), tirx.transform.VectorizeLoop(True), tvm.s_tir.transform.InjectVirtualThread(),
            tvm.s_tir.transform.InjectDoubleBuffer(), tirx.transform.StorageRewrite()])(mod)["probe"]


def _top_level(stmt) -> list:
    """The statements in sequence at the top of a body (under a root block, if any)."""
    if isinstance(stmt, tvm.s_tir.SBlockRealize):
        stmt = stmt.block.body
    return list(stmt.seq) if isinstance(stmt, tirx.SeqStmt) else [stmt]


def to_dynamic(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` with every ``shared`` buffer in ``shared.dyn`` (same shape, strides, name)."""
    new = {}
    for buf in _buffers(func.body, STATIC):
        ty = buf.ty
        strides = list(ty.strides) if ty.strides else None
        new[buf] = tirx.decl_buffer(list(ty.shape), str(ty.dtype), buf.name, strides=strides, scope=DYNAMIC,
                                    elem_offset=ty.elem_offset, data_alignment=int(ty.data_alignment),
                                    offset_factor=int(ty.offset_factor))
    if not new:
        return func
    return func.with_body(tvm_ffi.structural_map(func.body, (tvm.ir.Var, lambda v: new.get(v, v))))


@tvm.transform.module_pass(opt_level=0, name="souffle.DynamicSharedOverLimit")
def dynamic_shared_over_limit(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """Every CUDA PrimFunc whose kernels would declare over ``STATIC_SHARED_LIMIT`` bytes of
    static shared memory gets it as ``shared.dyn`` instead (before TVM's s_tir pipeline)."""
    target = tvm.target.Target.current(allow_none=True)
    for gv, f in list(mod.functions.items()):
        if not isinstance(f, tirx.PrimFunc):
            continue
        tgt = f.attrs["target"] if f.attrs is not None and "target" in f.attrs else target
        if tgt is None or tgt.kind.name != "cuda":
            continue
        if static_shared_bytes(f, tgt) > STATIC_SHARED_LIMIT:
            mod[gv] = to_dynamic(f)
    return mod
