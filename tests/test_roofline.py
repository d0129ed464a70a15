"""The roofline estimate follows its formula (values derived here from the hardware table)."""

import pytest

from souffle_tvm.cost import hardware
from souffle_tvm.report import roofline
from souffle_tvm.report.schema import KernelReport, Report


def _report(kernels):
    return Report("m", "cuda", "sm_90", "souffle", sum(k.launches for k in kernels), len(kernels), 0.0,
                  sum(k.launches * k.bytes for k in kernels), sum(k.launches * k.flops for k in kernels), {},
                  kernels)


def test_memory_bound_compute_bound_and_overheads_add_up():
    h = hardware.GPUS["h200"]
    mem = KernelReport("a", "a", [1, 1, 1], [256, 1, 1], 32, 0, 0, 3, 48_000_000, 1_000)         # bandwidth-bound
    comp = KernelReport("b", "b", [1, 1, 1], [256, 1, 1], 32, 0, 0, 1, 1_000, 10**12, grid_syncs=4)  # compute-bound
    r = roofline.estimate(_report([mem, comp]), h, "float32", compulsory_bytes=10**6)
    assert r.memory_seconds == pytest.approx(3 * 48_000_000 / h.dram_bandwidth)
    assert r.compute_seconds == pytest.approx(10**12 / h.fp32_flops)
    assert r.overhead_seconds == pytest.approx(4 * h.launch_overhead_s + 4 * h.grid_sync_overhead_s)
    assert r.seconds == pytest.approx(r.memory_seconds + r.compute_seconds + r.overhead_seconds)
    # one ideal kernel: compute-bound here (10^12 + 3000 flops), one launch
    assert r.floor == pytest.approx((10**12 + 3_000) / h.fp32_flops + h.launch_overhead_s)
    assert r.floor < r.seconds


def test_fp16_uses_the_tensor_core_peak():
    h = hardware.GPUS["h200"]
    k = KernelReport("b", "b", [1, 1, 1], [256, 1, 1], 32, 0, 0, 1, 0, 10**12)
    assert roofline.estimate(_report([k]), h, "float16").compute_seconds == pytest.approx(10**12 / h.fp16_flops)
