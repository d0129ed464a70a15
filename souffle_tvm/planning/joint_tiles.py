"""Joint tiling: an elementwise group cut into its producer's blocks where that keeps its reads
inside the block that wrote them.

A stitched kernel runs virtual block ``b`` of every stage on block ``b``, so a consumer whose
block ``b`` reads only what its producer's block ``b`` wrote follows it behind a block barrier,
not a grid sync, and the tensor can stay in that block's shared memory (``stitch.channel``).
The default rules tile each group alone: an LSTM's cell update (256 units, one block of 256
threads) reads the gates that its recurrent GEMV computed in 64 blocks of 16 columns, so every
step paid a grid sync between the two. Here such a consumer is scheduled again with its
producer's block count (``codegen.rules.AlignedTiles``: the LSTM's gates are interleaved by
unit, so a tile of 4 units reads one GEMV block's 16 columns), and the new tiling is kept
where the stitcher itself then finds the edge block-local (``onchip_credit.block_local``).

The choice is stamped on the unscheduled function (``ALIGNED_TILES_ATTR``), so every later
scheduling of the group at a stitched block size makes the same tiles; a group built alone
ignores it (the attribute only matters to a stitched kernel).
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import s_tir, tirx

from ..cost import hardware
from ..core.ir_names import ALIGNED_TILES_ATTR
from ..errors import StitchError
from ..stitch import lower
from . import onchip_credit
from .group_calls import GroupCalls
from .schedules import ScheduleCache


def align(calls: GroupCalls, unscheduled: tvm.IRModule, target: tvm.target.Target, block: int,
          schedule: ScheduleCache) -> dict[str, tuple[tirx.PrimFunc, tirx.PrimFunc]]:
    """Per group function name whose tiling changes: (its unscheduled function with the block
    count stamped, its schedule). A function called by several groups (repeated time steps) is
    decided at its first call whose producer it can follow block-locally."""
    gpu = hardware.for_arch(str(target.attrs["arch"]))
    outputs = onchip_credit.group_outputs(calls)
    stages: dict = {}

    def lowered(func: tirx.PrimFunc) -> list:
        """Its stages; none where they cannot be stages of a kernel (an empty function has no
        launch; other misfits the pair stitch in ``block_local`` refuses)."""
        if func not in stages:
            try:
                stages[func] = lower.lower_stage("g", func, target)
            except StitchError:
                stages[func] = []
        return stages[func]

    decided: dict[str, tuple] = {}
    tried: set = set()          # (producer function, consumer name): repeated steps ask once
    for g in sorted(calls.call_index):
        name = calls.calls[calls.call_index[g]].args[0].name_hint
        if name in decided or _reduces(unscheduled[name]):
            continue
        sg = lowered(calls.func(g))
        if len(sg) != 1:
            continue
        for p in onchip_credit.producers(calls, g, outputs):
            if (calls.func(p), name) in tried:
                continue
            tried.add((calls.func(p), name))
            sp = lowered(calls.func(p))
            if len(sp) != 1 or sp[0].num_blocks in (1, sg[0].num_blocks) or \
                    onchip_credit.block_local(calls, p, g, sp, sg, target, block, gpu, outputs):
                continue
            stamped = unscheduled[name].with_attr(ALIGNED_TILES_ATTR, tirx.IntImm("int32", sp[0].num_blocks))
            done = schedule(stamped)
            if done.rule == "AlignedTiles" and onchip_credit.block_local(
                    calls, p, g, sp, lowered(done.func), target, block, gpu, outputs):
                decided[name] = (stamped, done.func)
                break
    return decided


def _reduces(func: tirx.PrimFunc) -> bool:
    found = []
    tvm_ffi.structural_walk(func.body, (s_tir.SBlock, lambda b: found.append(
        any(iv.iter_type != 0 for iv in b.iter_vars))))
    return any(found)
