"""Register caps: where a stitched kernel's registers, not its shared memory or threads, hold
its blocks per SM down, how many registers one more block leaves, and whether the latency model
predicts the kernel faster with it. Whether the cap costs spills only ptxas knows: the ptxas
loop (``pipeline.feedback``) builds the capped kernels and keeps them only if it does not.
"""

from __future__ import annotations

import dataclasses
import math

from ..build.facts import BuildFacts, KernelFacts
from ..cost import hardware, latency

# Below this a stitched GEMM stage cannot hold its accumulators: ptxas would only spill.
MIN_CAP = 32


def register_cap(gpu: hardware.GPU, threads: int, blocks: int) -> int:
    """The most registers a thread may use for ``blocks`` blocks of ``threads`` per SM (what
    nvcc allocates under ``__launch_bounds__(threads, blocks)``: whole 256-register warp units)."""
    warps = -(-threads // gpu.warp_size)
    units = gpu.regs_per_sm // (blocks * warps * gpu.reg_alloc_unit)
    return min(gpu.regs_per_thread_max, units * gpu.reg_alloc_unit // gpu.warp_size)


def one_more_block(gpu: hardware.GPU, row: KernelFacts) -> tuple[int, int] | None:
    """(blocks per SM, register cap) for a cooperative kernel that does not spill and whose
    registers alone, not its shared memory or threads, hold its blocks per SM down: one block
    more, and the registers that leave room for it. None otherwise."""
    if not row.cooperative or row.registers is None or row.spill_bytes or not row.block:
        return None
    threads, shared = math.prod(row.block), row.shared_bytes or 0
    now = hardware.occupancy(gpu, threads, row.registers, shared)
    want = now.blocks_per_sm + 1
    cap = register_cap(gpu, threads, want)
    if now.limited_by != "registers" or cap < MIN_CAP or \
            hardware.occupancy(gpu, threads, cap, shared).blocks_per_sm < want:
        return None
    return want, cap


def register_caps(facts: BuildFacts, stitched: list, arch: str,
                  constants: latency.Constants = latency.FITTED) -> dict[str, tuple[int, int, str]]:
    """{stitched PrimFunc: (blocks per SM, grid, why)} for the cooperative kernels of ``facts``
    whose registers alone hold their blocks per SM down, where one more block per SM (registers
    capped to fit, the grid grown to match, up to the widest stage) is predicted faster than the
    kernel on the most blocks it can have now. ``stitched``: the ``StitchedKernel``s."""
    gpu = hardware.for_arch(arch)
    by_function = {k.function: k for k in stitched if len(k.stages) > 1}
    out = {}
    for row in facts.kernels:
        sk = by_function.get(row.primfunc)
        offer = one_more_block(gpu, row) if sk is not None else None
        if offer is None:
            continue
        want, cap = offer
        kernel = row.cost_kernel()
        # compared with the grid it could have uncapped: the cap is credited only with its own gain
        base = dataclasses.replace(kernel, grid=min((want - 1) * gpu.sms, sk.max_blocks))
        grid = min(want * gpu.sms, sk.max_blocks)
        before = latency.kernel_time(gpu, constants, base).seconds
        after = latency.kernel_time(gpu, constants, dataclasses.replace(kernel, registers=cap, grid=grid)).seconds
        if after < before:
            out[row.primfunc] = (want, grid, f"{row.registers} -> at most {cap} registers: {want} blocks per SM, "
                                             f"predicted {before * 1e6:.1f} -> {after * 1e6:.1f} us per launch")
    return out
