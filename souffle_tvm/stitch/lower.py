"""A scheduled stage PrimFunc lowered into the form the stitcher takes stages in.

Each stage PrimFunc (scheduled for one shared block size) is lowered through TVM's s_tir
pipeline up to ``LowerOpaqueBlock`` (``launch_form``: thread bindings are then
``thread_extent`` attributes, buffers still multi-dimensional). Its launch is then peeled off
(``lower_stage``): what remains is the body one block runs, its block and thread variables
with their extents, and its parameters — the pieces ``kernel.stitch`` re-homes in one launch.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import tvm
import tvm_ffi
from tvm import s_tir, tirx

from .kernel_ir import allreduce_threads, has_barrier
from ..errors import StitchError


def _prefix_passes():
    """TVM's s_tir pipeline up to and including LowerOpaqueBlock (copied from s_tir/pipeline.py)."""
    t = s_tir.transform
    return [t.CanonicalizeLoop(), t.LowerCrossThreadReduction(), t.LowerInitBlock(),
            t.PlanAndUpdateBufferAllocationLocation(), t.ConvertBlocksToOpaque(), t.LiftThreadBinding(),
            t.ManifestSharedMemoryLocalStage(), t.CompactBufferAllocation(), t.LowerAutoCopy(),
            t.UnifyThreadBinding(), t.LowerMatchBuffer(), t.StmtSimplify(), t.InjectPermutedLayout(),
            t.AnnotateIrregularLoop(), t.InjectSoftwarePipeline(), t.TransformMmaBufferLayout(),
            t.LowerOpaqueBlock()]


def _suffix_passes():
    """The rest of TVM's s_tir pipeline up to its thread syncs, without the passes that only
    rewrite instructions (what decides where ThreadSync puts a barrier: flat indices, merged
    allocations, unrolled loops)."""
    t = s_tir.transform
    return [tirx.transform.FlattenBuffer(), tirx.transform.NarrowDataType(32), t.LoopPartition(),
            tirx.transform.VectorizeLoop(True), t.InjectVirtualThread(), t.InjectDoubleBuffer(),
            tirx.transform.StorageRewrite(), t.HoistIfThenElse(), tirx.transform.UnrollLoop(),
            tirx.transform.StmtSimplify(), tirx.transform.RemoveNoOp(),
            t.ThreadSync("shared"), t.ThreadSync("shared.dyn")]


def launch_form(func: tirx.PrimFunc, target: tvm.target.Target, name: str) -> tirx.PrimFunc:
    """``func`` lowered to just before TVM's thread-sync passes: launch attributes, no blocks
    (the form stages are stitched in, and the emulator reads)."""
    mod = tirx.transform.BindTarget(target)(tvm.IRModule({name: func.with_attr("global_symbol", name)}))
    with target:
        return tvm.transform.Sequential(_prefix_passes())(mod)[name]


def in_launch_form(func) -> bool:
    """Whether ``func`` is a PrimFunc already in launch form (a stitched kernel): no SBlock but
    its root."""
    if not isinstance(func, tirx.PrimFunc):
        return False
    blocks: list = []
    tvm_ffi.structural_walk(func.body, (s_tir.SBlock, blocks.append))
    return all(b.name_hint == "root" for b in blocks)


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

    def kernel(self, target: tvm.target.Target) -> tirx.PrimFunc:
        """The stage as a kernel of its own: its body under its launch attributes again, with the
        block barriers TVM's build adds (ThreadSync): what ``cost.tir_counts`` counts a block of."""
        body = self.body
        for tag, (var, ext) in [*self.threads.items(), *self.blocks.items()]:
            i = tirx.const(0, str(var.ty)), tirx.const(ext, str(var.ty))
            body = tirx.AttrStmt(tirx.IterVar(tvm.ir.Range(*i), var, 1, tag), "thread_extent", i[1], body)
        mod = tvm.IRModule({"stage": tirx.PrimFunc(self.params, body)})
        with target:
            return tvm.transform.Sequential(_suffix_passes())(mod)["stage"]


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

    Cached: the partitioner asks per group and ``module.stitch_module`` asks again per subprogram.
    """
    try:
        stages = lower_stage("stage", func, target)
    except StitchError as err:
        return str(err)
    for st in stages:
        if st.num_threads > block or (st.num_threads < block and has_barrier(st.body)):
            return f"its schedule uses {st.num_threads} threads per block, the stitched kernel {block}"
        reduced = allreduce_threads(st.body)
        if reduced and not (st.num_threads == block and all(a.same_as(wide_thread(st)) for a in reduced)):
            # TVM lowers tvm_thread_allreduce only over launch threads; the stitched kernel's one
            # threadIdx.x stands for a stage's thread index only where it is as wide as the kernel
            return (f"a cross-thread reduction over {', '.join(map(str, reduced))} of its "
                    f"{' x '.join(f'{t}({e})' for t, (_, e) in st.threads.items())} threads, which the "
                    f"{block}-thread stitched kernel does not launch")
    return None


def wide_thread(stage: LoweredStage):
    """The stage's one thread variable of extent above 1, or None if it has none or several."""
    wide = [v for v, e in stage.threads.values() if e > 1]
    return wide[0] if len(wide) == 1 else None


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
