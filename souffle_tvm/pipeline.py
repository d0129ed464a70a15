"""The Souffle pipeline driver: lower → transforms → partition (with schedule feedback) → emit.

Data flows one way; each step is a module of its own. ``level`` selects the paper's ablation
level; "v2" (vertical transform, one kernel per anchor group, no grid sync) is what exists.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
import tvm_ffi


from . import emit, partition, schedule, te_program
from .transforms import fold_weights, horizontal, vertical
from .transforms.horizontal import HorizontalResult
from .transforms.vertical import VerticalResult

LEVELS = ("v0", "v1", "v2")  # none; + horizontal; + vertical (the paper's ablation levels)


@dataclass
class SouffleModule:
    mod: tvm.IRModule              # group PrimFuncs scheduled for the target
    unscheduled: tvm.IRModule      # the same module before scheduling (for flops/bytes)
    program: te_program.TEProgram
    vertical: VerticalResult | None
    horizontal: HorizontalResult | None
    partition: partition.Partition

    @property
    def params(self) -> list:
        """Weight arrays in the order the emitted ``main`` takes them (after the inputs)."""
        return self.program.weight_arrays()


def run(mod: tvm.IRModule, target: tvm.target.Target, params: list, level: str = "v2") -> SouffleModule:
    """Apply the Souffle pipeline to an imported module (inputs then weights as ``main`` params)."""
    if level not in LEVELS:
        raise ValueError(f"unknown level {level!r}; available: {', '.join(LEVELS)}")
    prog = fold_weights(te_program.lower(mod, weight_values=params)).program
    hres = horizontal(prog) if level in ("v1", "v2") else None
    prog1 = hres.program if hres else prog
    vres = vertical(prog1) if level == "v2" else None
    prog2 = vres.program if vres else prog1
    cache: dict = {}   # structural hash -> [(func, scheduled)]: each distinct group scheduled once

    def scheduled(func):
        bucket = cache.setdefault(tvm_ffi.structural_hash(func), [])
        for seen, done in bucket:
            if tvm_ffi.structural_equal(seen, func):
                return done
        done = schedule.schedule_group(func, target)
        bucket.append((func, done))
        return done

    def fits(group, outputs):
        """None when the group schedules as well as its anchor does alone; else why not."""
        func, _ = emit.group_primfunc(group, outputs)
        try:
            rule = scheduled(func).rule
        except schedule.ScheduleError as err:
            return str(err)
        anchor = group.anchor
        if anchor is None or len(group.members) == 1:
            return None
        alone, _ = emit.group_primfunc(partition.Group([anchor]), [anchor])
        try:
            anchor_rule = scheduled(alone).rule
        except schedule.ScheduleError:
            return None
        if schedule.RANK[rule] < schedule.RANK[anchor_rule]:
            return f"fused, dlight schedules it with {rule}; the anchor alone gets {anchor_rule}"
        return None

    part = partition.partition_v2(prog2, fits=fits)
    out = emit.emit_module(prog2, part, schedule=lambda f: scheduled(f).func)
    return SouffleModule(out, emit.emit_module(prog2, part), prog2, vres, hres, part)


