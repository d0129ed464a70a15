"""Each group's schedule, as the partitioner's questions and the build both ask for it: from the
tuning database where it holds a usable record, else from the default rules, once per
structurally distinct function (``ScheduleCache``), and the default rules' schedules shared
across compiles in one process (``default_schedule``)."""

from __future__ import annotations

import dataclasses

from tvm import tirx

from ..codegen import emit, schedule
from ..codegen.database import lookup
from ..core.ir_names import FORM_ATTR, NOTE_ATTR, SOURCE_ATTR
from ..core.structural import ByStructure
from ..core.targets import is_cuda
from ..stitch import lower


# The default rules' schedules, across compiles in one process (the rules are deterministic):
# (target, block size, K tile, GEMM tile, structural hash) -> [(group PrimFunc, Scheduled)]
_DEFAULT_SCHEDULES = ByStructure()


def default_schedule(func: tirx.PrimFunc, target, block_size: int | None = None, gemm_k_tile: int | None = None,
                     gemm_tile: int | None = None) -> schedule.Scheduled:
    """``schedule.schedule_group``, once per structurally distinct function and settings in a
    process (the two-phase pass asks for a GEMM's tile, the partitioner then schedules the same
    GEMM alone)."""
    return _DEFAULT_SCHEDULES(func, lambda: schedule.schedule_group(func, target, block_size, gemm_k_tile, gemm_tile),
                              key=(str(target), block_size, gemm_k_tile, gemm_tile))


class ScheduleCache:
    """Each structurally distinct group PrimFunc is scheduled once: from the tuning database
    when it holds a usable record for it (``database.lookup``), else by the default rules
    (whose schedules later compiles in the same process reuse)."""

    def __init__(self, target, block_size: int | None = None, gemm_k_tile: int | None = None, database=None,
                 gemm_tile: int | None = None):
        self.target = target
        self.block_size = block_size
        self.gemm_k_tile, self.gemm_tile = gemm_k_tile, gemm_tile
        self.database = database
        self.cache = ByStructure()
        self.failures = 0     # rules that raised, over every distinct function scheduled
        self.group_funcs = emit.GroupFuncs()    # the group PrimFuncs ``fused_or_alone`` made (emit reuses them)

    def __call__(self, func) -> schedule.Scheduled:
        return self.cache(func, lambda: self._schedule(func))

    def _schedule(self, func) -> schedule.Scheduled:
        done = self._tuned(func) if self.database is not None else None
        if not isinstance(done, schedule.Scheduled):
            why = done
            done = self._default(func)
            self.failures += done.failures
            if self.database is not None:    # say where each schedule came from (the report reads it)
                out = done.func.with_attr(SOURCE_ATTR, f"default: {done.rule}")
                done = dataclasses.replace(done, func=out.with_attr(NOTE_ATTR, why) if why else out)
        # the form the report checks against what a GPU has timed
        form = schedule.form_of(done.rule, self.block_size, done.func) if done.rule != "database" else f"database@{self.block_size}"
        return dataclasses.replace(done, func=done.func.with_attr(FORM_ATTR, form))

    def _default(self, func) -> schedule.Scheduled:
        return default_schedule(func, self.target, self.block_size, self.gemm_k_tile, self.gemm_tile)

    def _tuned(self, func) -> schedule.Scheduled | str | None:
        """The database's schedule of ``func``, or why its record cannot be used (None: no record)."""
        tuned, why = lookup(self.database, func, self.target)
        if tuned is None:
            return why
        if self.block_size is not None and is_cuda(self.target):
            # A stitched kernel has ONE block size: a tuned stage with other thread counts (or
            # virtual threads) would be refused by the stitcher, so the default rules keep it.
            bad = lower.why_not_stitchable(tuned, self.target, self.block_size)
            if bad is not None:
                return f"tuned schedule not used: {bad}"
        out = tuned.with_attr("tirx.is_scheduled", True).with_attr(SOURCE_ATTR, "database")
        return schedule.Scheduled(out, "database")
