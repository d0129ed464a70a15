"""What our schedule rules share: dlight's ``GPUScheduleRule``, narrowed to CUDA.

A rule's ``apply(func, target, tunable)`` returns a ``tvm.s_tir.Schedule`` when it schedules
``func`` and ``None`` when it does not apply (dlight's contract, ``tvm.s_tir.dlight.ScheduleRule``).
"""

from __future__ import annotations

import tvm
from tvm.s_tir.dlight.gpu.base import GPUScheduleRule

from ...core.targets import is_cuda


class CUDAScheduleRule(GPUScheduleRule):
    """A rule whose schedules use CUDA-only features (stitched-kernel layouts, ``atomicAdd``,
    wmma): available on CUDA targets only. A subclass of a dlight rule lists this class first,
    ``class R(CUDAScheduleRule, dl.gpu.Matmul)``, so dlight's own ``apply`` sees the narrower test."""

    def is_target_available(self, target: tvm.target.Target) -> bool:
        return super().is_target_available(target) and is_cuda(target)

