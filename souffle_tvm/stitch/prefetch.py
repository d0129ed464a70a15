"""V4's cross-stage optimisation: the next segment's inputs are prefetched into L2 before the
grid sync that separates them.

In a stitched kernel the stages between two grid syncs (a *segment*) cannot start before the
sync, but the buffers they read from outside the kernel (weights, the inputs of the model or
of an earlier kernel) do not depend on anything the kernel computes. So each block, once done
with its share of a segment, issues ``prefetch.global.L2`` for its share of the 128-byte lines
of the inputs the *next* segment reads first, then waits at the sync: that DRAM traffic
overlaps the wait for the slowest block and the sync itself, and the next segment finds its
weights in L2 (the paper's "tiles prefetched before the grid sync").

Why at the end of a segment rather than its start: there the stages' registers are dead
(at the start the loops made ResNeXt-101's kernels spill; docs/benchmarks.md has the figures).

A prefetch is a hint with no semantics: results are unchanged, the stitching checks and the
emulator ignore it (``kernel_ir.is_prefetch``). The lines one segment prefetches are capped at a
share of L2 so that they do not evict what the current segment is using.

It is a step of its own after stitching: ``plant_module`` plants the loops in the stitched
kernels of a module (``module.stitch_module``'s result).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import tvm
import tvm_ffi
from tvm import relax, tirx

from . import kernel_ir
from .module import StitchedKernel
from ..cost import tir_stats
from ..core.ir_names import PREFETCH

LINE_BYTES = 128                     # an L2 cache line on sm_80 / sm_90
L2_SHARE = 0.5                       # at most this share of L2 prefetched ahead of one segment


@dataclass(frozen=True)
class Prefetch:
    segment: int        # the segment whose end issues it (it is read first by segment + 1)
    buffer: tirx.Buffer
    bytes: int

    @property
    def name(self) -> str:
        return self.buffer.name


def _ptx():
    from tvm.backend.cuda.ptx import PTXNamespace

    return PTXNamespace()


def _segments(seq: list) -> list[list[int]]:
    """Positions of the statements between grid syncs, in order."""
    out: list[list[int]] = [[]]
    for i, stmt in enumerate(seq):
        if kernel_ir.is_grid_sync(stmt):
            out.append([])
        else:
            out[-1].append(i)
    return out


def plan(func: tirx.PrimFunc, l2_bytes: int) -> list[Prefetch]:
    """What ``plant`` prefetches: per segment after the first, the kernel's input buffers
    (never written by the kernel) that it reads before any earlier segment has, in parameter
    order, while the segment's total stays within ``L2_SHARE`` of ``l2_bytes``."""
    seq = kernel_ir.stage_loops(func)
    params = [p for p in func.params if hasattr(p, "ty") and hasattr(p.ty, "shape")]
    accesses = [kernel_ir.accesses(stmt) for stmt in seq]
    written = [p for p in params if any(b.same_as(p) for _, stores in accesses for b in stores)]
    inputs = [p for p in params if not any(p.same_as(w) for w in written)]
    seen: list = []
    out = []
    for s, positions in enumerate(_segments(seq)):
        reads = [p for p in inputs if any(b.same_as(p) for i in positions for b in accesses[i][0])]
        fresh = [p for p in reads if not any(p.same_as(q) for q in seen)]
        seen += fresh
        if s == 0:
            continue      # the first segment's inputs: nothing runs before it to overlap with
        budget = int(l2_bytes * L2_SHARE)
        for p in fresh:
            size = tir_stats.buffer_bytes(p)
            if size <= budget:
                out.append(Prefetch(s - 1, p, size))
                budget -= size
    return out


def _prefetch_loop(buf, gid, threads: int) -> tirx.Stmt:
    """Thread ``gid`` of ``threads`` prefetches lines gid, gid + threads, ... of ``buf``."""
    i64 = lambda v: tirx.const(v, "int64")  # noqa: E731
    numel = math.prod(int(d) for d in buf.ty.shape)
    per_line = max(LINE_BYTES // tir_stats.dtype_bytes(buf.ty.dtype), 1)
    lines = math.ceil(numel / per_line)
    # A flat view of the same memory: a line's address is one multiply, where the buffer's own
    # shape would cost a division per dimension (and registers the stages around need).
    flat = tirx.decl_buffer((numel,), buf.ty.dtype, buf.name + "_lines", data=buf.data)
    j = tirx.Var("pf", "int64")
    call = _ptx()["prefetch.global.L2"](tirx.address_of(tirx.BufferLoad(flat, [(gid + j * i64(threads)) * i64(per_line)])))
    trip = tirx.floordiv(i64(lines) - gid + i64(threads - 1), i64(threads))
    body = tirx.SeqStmt([tirx.DeclBuffer(flat, data=buf.data), tirx.Evaluate(call)])
    return tirx.For(j, i64(0), trip, tirx.ForKind.SERIAL, body, annotations={PREFETCH: i64(tir_stats.buffer_bytes(buf))})


def plant(func: tirx.PrimFunc, l2_bytes: int) -> tuple[tirx.PrimFunc, list[Prefetch]]:
    """``func`` (a stitched kernel) with the prefetches of ``plan`` just before each grid sync."""
    todo = plan(func, l2_bytes)
    if not todo:
        return func, []
    bid, grid = kernel_ir.launch_var(func, "blockIdx.x")
    tid, block = kernel_ir.launch_var(func, "threadIdx.x")
    gid = bid * tirx.const(block, "int64") + tid
    seq = kernel_ir.stage_loops(func)
    planted: dict[int, list] = {}
    for pf in todo:
        planted.setdefault(pf.segment, []).append(_prefetch_loop(pf.buffer, gid, grid * block))
    out, segment = [], 0
    for stmt in seq:
        if kernel_ir.is_grid_sync(stmt):
            out += planted.get(segment, [])
            segment += 1
        out.append(stmt)
    return kernel_ir.replace_stages(func, out), todo


def plant_module(mod: tvm.IRModule, kernels: list[StitchedKernel], l2_bytes: int,
                 skip: set[str]) -> tuple[tvm.IRModule, list[StitchedKernel]]:
    """``mod`` (``module.stitch_module``'s result) with the prefetches of ``plan`` planted in
    each stitched kernel except those named in ``skip``, and ``kernels`` with their
    ``prefetched_bytes`` filled in.

    Identical kernels share one PrimFunc, planted once. Where ``skip`` names only some of the
    kernels sharing a function, one function no longer serves them all: the kernels of the
    first one's kind keep it, the others call a copy of their own (named after the first of
    them), as if each had been given its own form when it was stitched.
    """
    sharing: dict[str, list[int]] = {}          # function -> its kernels (positions), in call order
    for n, k in enumerate(kernels):
        sharing.setdefault(k.function, []).append(n)
    gv_of = {gv.name_hint: gv for gv in mod.get_global_vars()}
    bb = relax.BlockBuilder(mod)
    calls_of = _stitched_calls(mod, [gv_of[f] for f in sharing])
    function_of: dict[int, tvm.ir.GlobalVar] = {}     # kernel position -> the function it calls
    redirect: list[tuple] = []                        # (call in main, the function it calls instead)
    planted_bytes: dict[int, int] = {}
    for fname, ns in sharing.items():
        gv = gv_of[fname]
        plain = mod[gv]
        planted, todo = plant(plain, l2_bytes)
        wants = [kernels[n].name not in skip for n in ns]
        for n, want in zip(ns, wants):
            function_of[n] = gv
            planted_bytes[n] = sum(p.bytes for p in todo) if want else 0
        if not todo or not any(wants):
            continue
        if wants[0]:
            bb.update_func(gv, planted)
        others = [n for n, want in zip(ns, wants) if want != wants[0]]
        if others:
            if len(calls_of[fname]) != len(ns):
                raise ValueError(f"main calls {fname} {len(calls_of[fname])} times, for {len(ns)} kernels")
            copy = bb.add_func(plain if wants[0] else planted, kernels[others[0]].name)
            for n, call in zip(ns, calls_of[fname]):
                if n in others:
                    function_of[n] = copy
                    redirect.append((call, copy))
    if redirect:
        main_gv = mod.get_global_var("main")
        bb.update_func(main_gv, tvm_ffi.structural_map(mod[main_gv], (relax.Call, lambda c: _redirected(c, redirect))))
    out = _in_stitching_order(mod, bb.get(), [function_of[n] for n in sorted(function_of)])
    done = [dataclasses.replace(k, prefetched_bytes=planted_bytes[n], function=function_of[n].name_hint)
            if n in function_of else k for n, k in enumerate(kernels)]
    return out, done


def _stitched_calls(mod: tvm.IRModule, functions: list) -> dict[str, list]:
    """The ``call_tir`` calls of each of ``functions`` in ``main``, in binding order."""
    out: dict[str, list] = {gv.name_hint: [] for gv in functions}
    for blk in mod["main"].body.blocks:
        for b in blk.bindings:
            v = b.value
            if isinstance(v, relax.Call) and getattr(v.op, "name", "") == "relax.call_tir" and \
                    isinstance(v.args[0], tvm.ir.GlobalVar) and v.args[0].name_hint in out:
                out[v.args[0].name_hint].append(v)
    return out


def _redirected(call, redirect: list[tuple]):
    for old, gv in redirect:
        if call.same_as(old):
            return relax.Call(call.op, [gv] + list(call.args[1:]), call.attrs, call.ty_args, call.span, call.ty)
    return call


def _in_stitching_order(before: tvm.IRModule, after: tvm.IRModule, calls: list) -> tvm.IRModule:
    """``after``'s functions in ``before``'s order, its stitched functions in the order their
    kernels first call them (``calls``: per kernel, the function it calls), placed where
    ``before`` had the first of them: the order ``stitch_module``'s BlockBuilder adds them in
    (``update_func`` would move a planted function to the end)."""
    stitched: list = []
    for gv in calls:
        if not any(gv.same_as(s) for s in stitched):
            stitched.append(gv)
    items, placed = [], False
    for gv, _ in before.functions.items():
        if not any(gv.same_as(s) for s in stitched):
            items.append((gv, after[gv]))
        elif not placed:
            items += [(s, after[s]) for s in stitched]
            placed = True
    return tvm.IRModule(dict(items), attrs=after.attrs, global_infos=after.global_infos)
