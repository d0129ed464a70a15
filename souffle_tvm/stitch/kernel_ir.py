"""The vocabulary of a stitched kernel's body: what its statements are and how to take it apart.

A stitched kernel (``kernel.stitch``) is one launch: a ``blockIdx.x`` and a ``threadIdx.x``
``thread_extent`` attribute around a sequence of *stage loops* (each a stage walking its blocks
grid-stride, annotated with the stage's own block and thread counts), the barriers between them
(grid syncs, block barriers), the V4 prefetch loops (``prefetch``) and the loops of repeated
stages (``rolling``). Every step that reads or rewrites such a body (the safety check, rolling,
prefetch, the emulator, the tests) uses these helpers, so none of them needs the stitcher itself.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import tirx

from . import dependence
from ..core.ir_names import FUSED, PREFETCH, STAGE_BLOCKS, STAGE_LANE, STAGE_THREADS

GRID_SYNC = "tirx.cuda.grid_sync"
BLOCK_BARRIERS = ("tirx.tvm_storage_sync", "tirx.tvm_thread_allreduce")
BARRIERS = (GRID_SYNC,) + BLOCK_BARRIERS


# -- calls and accesses ----------------------------------------------------------------------------
def op_name(node) -> str:
    return getattr(node.op, "name", "") if isinstance(node, tvm.ir.Call) else ""


def calls_to(node, names) -> list:
    """The calls in ``node`` to any op in ``names``."""
    found = []
    tvm_ffi.structural_walk(node, (tvm.ir.Call, lambda c: found.append(c) if op_name(c) in names else None))
    return found


def accesses(stmt) -> tuple[list, list]:
    """The buffers ``stmt`` loads, and those it stores to (atomic additions included)."""
    loads, stores = [], []
    tvm_ffi.structural_walk(stmt, [(tvm.ir.TensorLoad, lambda x: loads.append(x.source)),
                                   (tirx.BufferStore, lambda x: stores.append(x.buffer))])
    return loads, stores + dependence.atomic_targets(stmt)


def has_barrier(stmt) -> bool:
    """A block barrier or shared memory (which ThreadSync will guard with barriers)."""
    shared = []
    tvm_ffi.structural_walk(stmt, (tirx.AllocBuffer, lambda a: shared.append(a)
                                   if str(a.buffer.ty.storage_scope).startswith("shared") else None))
    return bool(shared) or bool(calls_to(stmt, BLOCK_BARRIERS))


def has_grid_sync(func: tirx.PrimFunc) -> bool:
    return bool(calls_to(func.body, (GRID_SYNC,)))


# -- the top-level statements ------------------------------------------------------------------------
def is_grid_sync(stmt) -> bool:
    return isinstance(stmt, tirx.Evaluate) and op_name(stmt.value) == GRID_SYNC


def is_prefetch(stmt) -> bool:
    return isinstance(stmt, tirx.For) and PREFETCH in stmt.annotations


def is_fused(stmt) -> bool:
    """A loop running several stages per virtual block (``channel``)."""
    return isinstance(stmt, tirx.For) and FUSED in stmt.annotations


def fused_parts(stmt) -> list:
    """A fused loop's stages (one-trip loops carrying the stage annotations) and the barriers
    between them, in order (its channel allocations left out)."""
    body = stmt.body
    seq = list(body.seq) if isinstance(body, tirx.SeqStmt) else [body]
    return [s for s in seq if not isinstance(s, tirx.AllocBuffer)]


def flat_stages(func: tirx.PrimFunc) -> list[tuple]:
    """The stitched body's top-level sequence with every fused loop opened: ``(stmt, loop)``,
    ``loop`` the fused loop whose variable walks ``stmt``'s virtual blocks (None at top level)."""
    out = []
    for stmt in stage_loops(func):
        out += [(s, stmt) for s in fused_parts(stmt)] if is_fused(stmt) else [(stmt, None)]
    return out


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


# -- the launch ------------------------------------------------------------------------------------
def launch_vars(func) -> set:
    """The names of every launch variable (block and thread indices) in ``func``."""
    names = set()
    tvm_ffi.structural_walk(func.body, (tirx.AttrStmt, lambda a: names.add(a.node.var.name)
                                        if a.attr_key == "thread_extent" else None))
    return names


def launch_var(func, tag: str):
    """The variable and extent of the launch attribute ``tag`` ("blockIdx.x"...), or (None, 0)."""
    node = func.body
    while isinstance(node, tirx.AttrStmt) and node.attr_key == "thread_extent":
        if node.node.thread_tag == tag:
            return node.node.var, int(node.value)
        node = node.body
    return None, 0


ALLREDUCE = "tirx.tvm_thread_allreduce"


def allreduce_threads(stmt) -> list:
    """The thread arguments of every cross-thread reduction (``tvm_thread_allreduce``) in ``stmt``:
    the thread variables it reduces over (TVM lowers it only where each one is a launch thread)."""
    out: list = []
    for call in calls_to(stmt, [ALLREDUCE]):
        size = int(call.args[0].value)
        # (size, sources..., condition, results..., thread vars...)
        out += list(call.args[2 + 2 * size:])
    return out


def decompose(value, extents: list[tuple]) -> dict:
    """x, y, z coordinates of a linear id over (var, extent) pairs in x-fastest order."""
    out, stride = {}, 1
    for var, ext in extents:
        out[var] = tirx.floormod(tirx.floordiv(value, stride), ext) if stride > 1 else tirx.floormod(value, ext)
        stride *= ext
    return out


def stage_view(stmt, bid, tid, grid: int, loop=None) -> dependence.StageView | None:
    """A stitched stage loop back in vb form (None if it is not one the stitcher wrote); a stage
    of a fused loop with that ``loop``, whose variable walks its virtual blocks."""
    ann = stmt.annotations if isinstance(stmt, tirx.For) else {}
    if STAGE_BLOCKS not in ann or STAGE_THREADS not in ann:
        return None
    threads = int(ann[STAGE_THREADS])
    body = _unguarded(stmt.body, tid < tirx.const(threads, "int64"))
    it = (loop if loop is not None else stmt).loop_var
    lane = int(ann[STAGE_LANE]) if STAGE_LANE in ann else 0
    vb = it * tirx.const(grid, "int64") + lane_block(bid, lane, grid)
    body = tvm_ffi.structural_map(body, (tirx.Add, lambda e: dependence.VB if tvm_ffi.structural_equal(e, vb) else e))
    return dependence.StageView(body, tid, int(ann[STAGE_BLOCKS]), threads, lane)


def _unguarded(body: tirx.Stmt, guard) -> tirx.Stmt:
    """A stage loop's body without its thread guard (``tid < threads``, the stage's own threads of
    the kernel's), also where block barriers come before it: a stage that reads a resident
    channel after a grid sync begins with one (``kernel.stitch``). With the guard left in, every
    store of such a stage proved nothing, and the static check refused a stacked channel the
    plan had proved (issue 58, item 2: an LSTM's gate sum, one slot per step)."""
    seq = list(body.seq) if isinstance(body, tirx.SeqStmt) else [body]
    lead = 0
    while lead < len(seq) - 1 and dependence.is_block_barrier(seq[lead]):
        lead += 1
    last = seq[lead]
    if lead != len(seq) - 1 or not (isinstance(last, tirx.IfThenElse) and last.else_case is None and
                                     tvm_ffi.structural_equal(last.condition, guard)):
        return body
    return tirx.SeqStmt(seq[:lead] + [last.then_case]) if lead else last.then_case


def lane_block(bid, lane: int, grid: int) -> tirx.PrimExpr:
    """The block index a stage on ``lane`` walks its virtual blocks from: ``bid`` rotated so that
    its virtual block 0 runs on block ``lane`` (``waves``); ``bid`` itself on lane 0."""
    if lane % grid == 0:
        return bid
    return tirx.floormod(bid + tirx.const(grid - lane % grid, "int64"), tirx.const(grid, "int64"))
