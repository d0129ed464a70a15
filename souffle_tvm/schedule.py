"""Per-group schedules: TVM's dlight rules on CUDA; the plain loop nest on llvm (the CPU twin).

Rules are tried in dlight's order (Matmul, GEMV, Reduction, GeneralReduction, Fallback); a
rule that raises on a fused group is skipped like one that does not match, so the result
says *which* rule scheduled the group. The partitioner compares that with the rule its anchor
gets alone: fusing must not degrade a tiled GEMM to the fallback schedule.
"""

from __future__ import annotations

import functools
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


def _rules(block_size: int | None):
    from tvm.s_tir import dlight as dl

    if block_size is None:
        return [dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(), dl.gpu.Fallback()]
    # One block size for every stage of a stitched kernel: rules whose thread count is fixed
    # by the rule itself (GEMV, Reduction) are left out.
    if block_size != 256:
        raise ScheduleError(f"stitched stages are scheduled with 256 threads (asked: {block_size})")
    return [_Matmul256(), dl.gpu.GeneralReduction(), dl.gpu.Fallback()]


@functools.cache
def _matmul256_class():
    from tvm.s_tir import dlight as dl

    class Matmul256(dl.gpu.Matmul):
        """dlight's GEMM schedule with a 16x16 thread block (dlight's own CUDA choice is 8x16)."""

        def get_configs(self, target):
            config = super().get_configs(target)
            config.block_size_x = 16
            return config

    return Matmul256


def _Matmul256():  # noqa: N802
    return _matmul256_class()()


def schedule_group(func: tirx.PrimFunc, target: tvm.target.Target, block_size: int | None = None) -> Scheduled:
    """Schedule ``func`` for ``target`` with the first dlight rule that applies.

    ``block_size`` forces every rule to use that many threads per block (stitched kernels).
    """
    if not is_cuda(target):
        return Scheduled(func, "none")
    if block_size is not None:
        attrs = dict(target.attrs)
        attrs.update({"kind": "cuda", "max_num_threads": block_size, "max_threads_per_block": block_size})
        attrs.pop("keys", None)
        target = tvm.target.Target(attrs)
    failures = []
    with target:
        for rule in _rules(block_size):
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
            name = type(rule).__name__.replace("Matmul256", "Matmul")
            return Scheduled(out, name, "; ".join(failures))
    raise ScheduleError("no dlight rule schedules it: " + "; ".join(failures))
