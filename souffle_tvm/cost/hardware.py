"""GPU limits (one table) and the CUDA occupancy calculation that the grid-sync limit needs.

Figures: NVIDIA's CUDA C Programming Guide, "Compute Capabilities" tables, and the data
sheets of each part; the H200's SM count and L2 were read on a real H200 (docs/gpu-check.md).
Occupancy follows the CUDA occupancy calculator: registers are allocated per warp in units
of 256, warps per block rounded up, shared memory in 128-byte units plus 1 KB reserved per
block (sm_80 and later).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class GPU:
    name: str
    arch: str
    sms: int
    regs_per_sm: int = 65536
    regs_per_thread_max: int = 255
    reg_alloc_unit: int = 256            # registers, per warp
    smem_per_sm: int = 233472            # bytes usable by blocks (228 KB on sm_80/sm_90)
    l1_shared_per_sm: int = 256 * 1024   # the L1 data cache and shared memory together (one carve-out)
    smem_per_block_static: int = 49152
    smem_per_block_optin: int = 232448   # 227 KB with cudaFuncSetAttribute
    smem_alloc_unit: int = 128
    smem_reserved_per_block: int = 1024
    threads_per_sm: int = 2048
    threads_per_block: int = 1024
    blocks_per_sm: int = 32
    warp_size: int = 32
    # The rest feeds the roofline estimate (report/roofline.py) and V4's prefetch budget (L2).
    dram_bandwidth: float = 2.039e12     # bytes/s
    fp32_flops: float = 19.5e12
    fp16_flops: float = 312e12           # dense tensor-core peak
    l2_bytes: int = 50 * 2**20           # what V4 may prefetch into (prefetch.L2_SHARE of it per segment)
    launch_overhead_s: float = 3e-6
    # The static floors (cost/floors.py) read these at their most optimistic.
    clock_hz: float = 1.98e9             # boost clock
    l2_bandwidth: float = 12e12          # bytes/s: above every published L2 measurement of the part
    grid_sync_overhead_s: float = 2e-6


GPUS = {
    "a100": GPU("A100-SXM4-80GB", "sm_80", sms=108, smem_per_sm=167936, smem_per_block_optin=166912,
                l1_shared_per_sm=192 * 1024,
                dram_bandwidth=2.039e12, fp32_flops=19.5e12, fp16_flops=312e12, l2_bytes=40 * 2**20,
                clock_hz=1.41e9, l2_bandwidth=7.2e12),
    "h100": GPU("H100-SXM", "sm_90", sms=132, dram_bandwidth=3.35e12, fp32_flops=67e12, fp16_flops=989e12),
    "h200": GPU("H200", "sm_90", sms=132, dram_bandwidth=4.8e12, fp32_flops=67e12, fp16_flops=989e12,
                l2_bytes=60 * 2**20),
}
DEFAULT_FOR_ARCH = {"sm_80": "a100", "sm_86": "a100", "sm_89": "h100", "sm_90": "h200"}


def for_arch(arch: str) -> GPU:
    return GPUS[DEFAULT_FOR_ARCH.get(arch, "h200")]


@dataclass(frozen=True)
class Occupancy:
    blocks_per_sm: int
    limited_by: str          # "registers" | "shared memory" | "threads" | "blocks"

    def max_coresident(self, gpu: GPU) -> int:
        return self.blocks_per_sm * gpu.sms


@functools.lru_cache(maxsize=65536)   # the time partitioner asks millions of times (LSTM: 8.9M calls)
def occupancy(gpu: GPU, threads_per_block: int, registers_per_thread: int, shared_bytes_per_block: int) -> Occupancy:
    """Resident blocks per SM for a kernel with these resources (0 if it cannot launch at all)."""
    if threads_per_block > gpu.threads_per_block or registers_per_thread > gpu.regs_per_thread_max:
        return Occupancy(0, "threads" if threads_per_block > gpu.threads_per_block else "registers")
    if shared_bytes_per_block > gpu.smem_per_block_optin:      # beyond what a block may opt in to
        return Occupancy(0, "shared memory")
    warps = math.ceil(threads_per_block / gpu.warp_size)
    regs_per_warp = math.ceil(max(registers_per_thread, 1) * gpu.warp_size / gpu.reg_alloc_unit) * gpu.reg_alloc_unit
    by_regs = (gpu.regs_per_sm // (regs_per_warp * warps))
    smem = math.ceil(shared_bytes_per_block / gpu.smem_alloc_unit) * gpu.smem_alloc_unit + gpu.smem_reserved_per_block
    by_smem = gpu.smem_per_sm // smem
    by_threads = gpu.threads_per_sm // (warps * gpu.warp_size)
    limits = {"registers": by_regs, "shared memory": by_smem, "threads": by_threads, "blocks": gpu.blocks_per_sm}
    name = min(limits, key=limits.get)
    return Occupancy(max(limits[name], 0), name)
