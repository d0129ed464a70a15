"""Per-group schedules: TVM's dlight rules on CUDA; the plain loop nest on llvm (the CPU twin).

Rules are tried in dlight's order (Matmul, GEMV, Reduction, GeneralReduction, Fallback); a
rule that raises on a fused group is skipped like one that does not match, so the result
says *which* rule scheduled the group. The partitioner compares that with the rule its anchor
gets alone: fusing must not degrade a tiled GEMM to the fallback schedule.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import tirx

from .errors import SouffleError
from .targets import is_cuda


class ScheduleError(SouffleError):
    """A group's PrimFunc could not be scheduled as one kernel."""


@dataclass
class Scheduled:
    func: tirx.PrimFunc
    rule: str          # the dlight rule that applied ("none" on llvm)
    notes: str = ""    # rules that raised before one applied


# How much of the hardware a rule's schedule uses; fusing must not lower it.
RANK = {"Matmul": 3, "GEMV": 2, "Reduction": 2, "GeneralReduction": 2, "Fallback": 0, "none": 0}


def _rules():
    from tvm.s_tir import dlight as dl

    return [dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(), dl.gpu.Fallback()]


def schedule_group(func: tirx.PrimFunc, target: tvm.target.Target) -> Scheduled:
    """Schedule ``func`` for ``target`` with the first dlight rule that applies."""
    if not is_cuda(target):
        return Scheduled(func, "none")
    failures = []
    with target:
        for rule in _rules():
            try:
                sch = rule.apply(func, target, False)
            except Exception as err:  # noqa: BLE001 - a rule's assertion means "does not apply here"
                lines = str(err).strip().splitlines()
                failures.append(f"{type(rule).__name__}: {type(err).__name__} {(lines[-1] if lines else '')[:120]}")
                continue
            if sch is None:
                continue
            if isinstance(sch, list):
                sch = sch[0]
            out = sch.mod["main"].with_attr("tirx.is_scheduled", True)
            return Scheduled(out, type(rule).__name__, "; ".join(failures))
    raise ScheduleError("no dlight rule schedules it: " + "; ".join(failures))
