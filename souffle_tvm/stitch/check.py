"""The static safety check of a stitched kernel: every barrier its dependences need is there,
no barrier sits where some threads would never reach it, and the grid can be co-resident."""

from __future__ import annotations

from dataclasses import dataclass

import tvm_ffi
from tvm import tirx

from . import dependence
from .kernel_ir import (BARRIERS, accesses, calls_to, flat_stages, fused_parts, is_fused, is_grid_sync, is_prefetch,
                        launch_var, launch_vars, op_name, stage_loops, stage_view)
from .rolling import unroll, unstack
from ..core.ir_names import STAGE_BLOCKS


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


def _channels(loop) -> list:
    """The shared buffers a fused loop allocates per iteration (its channels)."""
    seq = loop.body.seq if isinstance(loop.body, tirx.SeqStmt) else [loop.body]
    return [s.buffer for s in seq if isinstance(s, tirx.AllocBuffer)]


def check(func: tirx.PrimFunc, grid: int, max_coresident: int | None) -> SafetyReport:
    """Prove the stitched kernel safe, or say what is wrong.

    1. every stage that reads a buffer an earlier stage wrote has the barrier the dependence
       needs in between: a grid sync unless ``dependence`` proves the reads block-local (then a
       block barrier) or thread-local; a stage that writes a buffer an earlier stage read or
       wrote has a grid sync in between; the same for the channels of a fused loop, whose
       iterations end with a block barrier when a block can run more than one;
    2. no barrier (grid sync, __syncthreads, cross-thread reduction) sits under a condition
       that depends on the thread or block index (some threads would never arrive);
    3. the grid fits the co-resident limit (when it is known).
    """
    func = unstack(unroll(func))    # a rolled loop is checked as the statements it executes
    problems = []
    bid, launched = launch_var(func, "blockIdx.x")
    tid, _ = launch_var(func, "threadIdx.x")
    written: list = []          # (param, view, block barriers seen when written) since the last grid sync
    touched: list = []          # params read or written since the last grid sync
    stages = syncs = barriers = 0
    resident = [s.buffer for s in stage_loops(func) if isinstance(s, tirx.AllocBuffer)]
    for stmt, loop in flat_stages(func):
        if is_grid_sync(stmt):
            syncs += 1
            written, touched = [], []
            continue
        if dependence.is_block_barrier(stmt):
            barriers += 1
            continue
        if is_prefetch(stmt) or isinstance(stmt, tirx.AllocBuffer):
            continue
        stages += 1
        view = stage_view(stmt, bid, tid, launched, loop) if bid is not None and tid is not None else None
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
        # the channels (per-block shared buffers: the kernel's resident ones, a fused loop's) are
        # checked as the params are
        chans = resident + (_channels(loop) if loop is not None else [])
        mine = [p for p in list(func.params) + chans if any(b.same_as(p) for b in stores)]
        for p in mine:       # write after read / write: the stitcher always orders these with a grid sync
            if any(t.same_as(p) for t in touched):
                problems.append(f"stage {stages} writes {p.name}, which an earlier stage uses, with no grid sync between")
        written += [(p, view, barriers) for p in mine]
        touched += mine + [p for p in list(func.params) + chans if any(b.same_as(p) for b in loads)]
    for stmt in stage_loops(func):
        if is_fused(stmt) and _channels(stmt) and launched and not dependence.is_block_barrier(fused_parts(stmt)[-1]):
            blocks = max(int(p.annotations[STAGE_BLOCKS]) for p in fused_parts(stmt)
                         if isinstance(p, tirx.For) and STAGE_BLOCKS in p.annotations)
            if blocks > launched:
                problems.append(f"a fused loop over {blocks} virtual blocks on {launched} blocks overwrites its "
                                "channels with no block barrier after their readers")
    launch = launch_vars(func)

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
