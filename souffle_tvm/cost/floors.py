"""Static floors on a kernel's GPU time: what no schedule of its work can beat, from facts the
build has (its bytes and flops, its launch, and what one block executes, counted from the
lowered TIR by ``cost.tir_counts``).

The latency model (``cost.latency``) is fitted; these are not. Each floor is a physical limit
taken at its most optimistic, so that a prediction below it is wrong, not merely uncertain:

* **memory:** every byte the kernel moves crosses L2 at least once, at an L2 bandwidth above
  any published measurement of the part (``GPU.l2_bandwidth``);
* **arithmetic:** the busiest SM runs at least ``ceil(blocks / SMs)`` blocks' flops at its share
  of the datasheet peak (tensor cores where the stage uses them; half2 SIMT for 2-byte types);
* **shared memory:** an SM serves one 128-byte wavefront of shared memory per clock; a warp's
  shared access takes at least one wavefront per 16 bytes a lane moves (the widest vector
  access, every lane reading the same address);
* **L1 data path:** shared memory and the L1 cache share one 128-byte-per-clock data path per SM,
  and a warp's global request passes it one 32-byte sector at a time (four sectors a clock):
  uncoalesced loads (a lane per row: 32 sectors a request) cost eight times a coalesced fp32
  load's cycles however well the lines hit in cache;
* **K-step chain:** a serial loop step that loads from global memory into shared memory and then
  waits at a block barrier cannot end before that load returns (``LOAD_LATENCY_CYCLES``, an L2
  hit); a software-pipelined step still waits at its barrier (``BARRIER_CYCLES``); the block's
  own shared-memory reads come between those waits. Blocks that are not resident together run
  these chains one wave after another.

A stitched kernel's stages run one after another (grid syncs between them): its floor is the
sum of its stages' floors and of its grid syncs' (``GRID_SYNC_CYCLES`` each), and at least the
floors of what its blocks execute in all.
"""

from __future__ import annotations

import math

from .hardware import GPU
from .work import BlockCounts

# An L2 hit on sm_80/sm_90 takes about 200-270 cycles (microbenchmarks); the floor takes the low end.
LOAD_LATENCY_CYCLES = 200
# A grid-wide barrier ends no sooner than one L2 round trip: the last block's arrival (an atomic
# at L2) must come back in a load of every waiting block. Measured grid syncs take microseconds;
# the floor takes this physical minimum.
GRID_SYNC_CYCLES = LOAD_LATENCY_CYCLES


def _peak(gpu: GPU, tensor_core: bool, elem_bytes: int) -> float:
    if tensor_core:
        return gpu.fp16_flops
    return gpu.fp32_flops * (2 if elem_bytes == 2 else 1)     # half2: two lanes per FMA


def stage_floors(gpu: GPU, tiles: int, nbytes: int, flops: int, tensor_core: bool = False,
                 elem_bytes: int = 4, shared_wavefronts: float = 0.0, k_steps: int = 0,
                 slots: int | None = None) -> dict[str, float]:
    """Seconds, by name, of each floor of one stage of ``tiles`` blocks (``shared_wavefronts`` and
    ``k_steps`` per tile, where a schedule rule knows them before anything is built)."""
    if tiles <= 0:
        return {}
    per_sm = math.ceil(tiles / gpu.sms)
    out = {"memory": nbytes / gpu.l2_bandwidth,
           "arithmetic": per_sm * flops / tiles / (_peak(gpu, tensor_core, elem_bytes) / gpu.sms)}
    if shared_wavefronts:
        out["shared"] = per_sm * shared_wavefronts / gpu.clock_hz
    if k_steps:
        waves = math.ceil(tiles / slots) if slots else 1
        out["k_chain"] = waves * k_steps * LOAD_LATENCY_CYCLES / gpu.clock_hz
    return out


def compute_cycles(gpu: GPU, block_flops: float, tensor_core: bool = False, elem_bytes: int = 4) -> float:
    """Cycles one block's ``block_flops`` take alone on an SM at its full share of the peak."""
    return block_flops / (_peak(gpu, tensor_core, elem_bytes) / gpu.sms / gpu.clock_hz)


def block_floors(gpu: GPU, grid: int, slots: int, counts: BlockCounts, block_cycles: float = 0.0) -> dict[str, float]:
    """Seconds, by name, of the floors of what a kernel's blocks execute (``counts``: one block's).

    ``k_chain``: a block whose steps end at barriers does its own shared-memory work between
    them, after each unpipelined step's load has returned (the next step's load is issued only
    after the barrier that ends this step's reads): alone on its SM it takes at least its steps'
    latencies plus its wavefronts at one per clock, and blocks that are not resident together
    run one wave after another. Every floor also holds for the busiest block alone (a stitched
    kernel whose stage has fewer tiles than the grid: block 0 runs a tile, the last none).
    ``block_cycles``: the arithmetic of an average block (``compute_cycles``), in the chain of the
    busiest block (at least average) or of every block where all blocks count the same."""
    if grid <= 0:
        return {}
    waves = math.ceil(grid / max(slots, 1))
    per_sm = math.ceil(grid / gpu.sms)
    busy = counts.busiest or counts
    return {"shared": max(per_sm * counts.shared_wavefronts, busy.shared_wavefronts) / gpu.clock_hz,
            "l1": max(per_sm * counts.l1_wavefronts, busy.l1_wavefronts) / gpu.clock_hz,
            "k_chain": max(waves * counts.chain_cycles(LOAD_LATENCY_CYCLES, 0.0 if counts.busiest else block_cycles),
                           busy.chain_cycles(LOAD_LATENCY_CYCLES, block_cycles)) / gpu.clock_hz}


def binding(floors: dict[str, float]) -> tuple[str | None, float]:
    """(name, seconds) of the largest floor; (None, 0) where there is none."""
    if not floors:
        return None, 0.0
    name = max(floors, key=floors.get)
    return name, floors[name]
