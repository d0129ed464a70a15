"""What our schedule rules share: dlight's ``GPUScheduleRule``, narrowed to CUDA.

A rule's ``apply(func, target, tunable)`` returns a ``tvm.s_tir.Schedule`` when it schedules
``func`` and ``None`` when it does not apply (dlight's contract, ``tvm.s_tir.dlight.ScheduleRule``).
"""

from __future__ import annotations

import tvm
from tvm import s_tir, tirx
from tvm.s_tir.dlight.gpu.base import GPUScheduleRule

from ...core.targets import is_cuda


class CUDAScheduleRule(GPUScheduleRule):
    """A rule whose schedules use CUDA-only features (stitched-kernel layouts, ``atomicAdd``,
    wmma): available on CUDA targets only. A subclass of a dlight rule lists this class first,
    ``class R(CUDAScheduleRule, dl.gpu.Matmul)``, so dlight's own ``apply`` sees the narrower test."""

    def is_target_available(self, target: tvm.target.Target) -> bool:
        return super().is_target_available(target) and is_cuda(target)


    def root_blocks(self, func, target) -> tuple[s_tir.Schedule, list] | None:
        """A schedule of ``func`` and its root's child blocks, where the rule may look at it (a
        PrimFunc, a CUDA target); None otherwise: what every rule's ``apply`` starts from."""
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        sch = s_tir.Schedule(func)
        return sch, sch.get_child_blocks(sch.get_sblock("root"))
