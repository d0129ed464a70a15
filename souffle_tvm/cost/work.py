"""What a kernel's work is, as the IR readers count it and the cost model prices it.

The shared vocabulary of ``cost``: ``Stage`` (one stage's launch, bytes and flops) and
``BlockCounts`` (what one block executes, counted from lowered TIR), with the hardware granules
they are counted in. The readers (``tir_stats``, ``tir_counts``) build these; the floors and the
latency model price them; neither side imports the other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

# bar.sync with every warp already there: about 20 cycles.
BARRIER_CYCLES = 20
# bytes of shared memory one SM serves per clock (32 banks of 4 bytes): one wavefront
WAVEFRONT_BYTES = 128
# the widest shared access a lane makes (ld.shared.v4.b32)
WIDEST_LANE_ACCESS = 16
# the granule of a global memory access; an SM's L1 data path moves WAVEFRONT_BYTES of it a clock
SECTOR_BYTES = 32



@dataclass(frozen=True)
class BlockCounts:
    """What one block executes (the block with the least work: a grid-stride loop's last
    block), counted from a lowered kernel's TIR (``cost.tir_counts``).

    ``shared_wavefronts``: shared-memory wavefronts its warps need at least; ``k_steps``: serial
    loop steps that wait on a global load at a block barrier; ``pipelined_steps``: serial steps
    with a barrier whose loads were issued ahead (through registers or ``cp.async``);
    ``global_requests``: its warps' global loads and stores; ``global_sectors``: the 32-byte
    sectors they touch (``global_sectors / global_requests`` is sectors per request: 4 for
    coalesced fp32, 32 where each lane reads another row)."""
    threads: int
    shared_wavefronts: float = 0.0
    k_steps: int = 0
    pipelined_steps: int = 0
    barriers: int = 0
    global_requests: float = 0.0
    global_sectors: float = 0.0
    # what the block with the MOST work executes (block 0: a grid-stride loop's first block), where
    # it differs: the kernel cannot end before that block either
    busiest: "BlockCounts | None" = None

    @classmethod
    def from_dict(cls, d: dict) -> "BlockCounts":
        d = dict(d)
        busiest = d.pop("busiest", None)
        return cls(**d, busiest=cls.from_dict(busiest) if busiest else None)

    def rounded(self) -> "BlockCounts":
        """These counts as they are kept (``as_dict`` rounds fractional counts to 2 decimals),
        which is what a report row carries and the latency model prices."""
        return BlockCounts.from_dict(self.as_dict())

    def chain_cycles(self, step_cycles: float, compute_cycles: float = 0.0) -> float:
        """One block alone: its unpipelined steps at ``step_cycles`` each, its pipelined steps'
        barriers, and between them its shared wavefronts and its arithmetic (``compute_cycles``:
        a step computes only after its barrier, and the next loads only after the next barrier);
        0 without steps."""
        if not (self.k_steps or self.pipelined_steps):
            return 0.0
        return (self.k_steps * step_cycles + self.pipelined_steps * BARRIER_CYCLES + self.shared_wavefronts
                + compute_cycles)

    @property
    def l1_wavefronts(self) -> float:
        """Cycles of the SM's L1/shared data path the block needs: its shared wavefronts and its
        global sectors, four to a cycle."""
        return self.shared_wavefronts + self.global_sectors * SECTOR_BYTES / WAVEFRONT_BYTES

    def as_dict(self) -> dict:
        out = {"threads": self.threads, "shared_wavefronts": round(self.shared_wavefronts, 2),
               "k_steps": self.k_steps, "pipelined_steps": self.pipelined_steps, "barriers": self.barriers,
               "global_requests": round(self.global_requests, 2), "global_sectors": round(self.global_sectors, 2)}
        if self.busiest is not None:
            out["busiest"] = self.busiest.as_dict()
        return out


@dataclass(frozen=True)
class Stage:
    """One stage's work: as a kernel of its own it would launch ``tiles`` blocks of ``threads``.
    ``bytes``: its global footprint; ``written_bytes``: what it stores (0: unknown), whose
    elements of ``elem_bytes`` size the operand traffic of a contraction's tile."""
    tiles: int
    threads: int
    bytes: int
    flops: int
    tensor_core: bool = False
    written_bytes: int = 0
    elem_bytes: int = 4
    shared_wavefronts: float = 0.0   # per tile, where a rule knows it before building (floors)
    k_steps: int = 0                 # per tile: unpipelined K steps, each waiting on a global load
    sectors: float = 0.0             # per tile: 32-byte sectors its global requests touch, counted with
                                     # the stage alone or stitched alone (a stitched Kernel's stages carry
                                     # them too: its own counts do not say which stage's tiles move them)

    def read_on_chip(self, taken: int) -> "Stage":
        """This stage with ``taken`` of its bytes read on chip instead (a channel, a resident
        copy): its global sectors fall in proportion to the bytes left off chip."""
        left = max(self.bytes - taken, 0)
        return replace(self, bytes=left, sectors=self.sectors * left / self.bytes if self.bytes > 0 else 0.0)

    def tile_loads(self) -> float:
        """Bytes one tile loads: its share of the footprint, or for a contraction the operand
        panels of a square output tile of side m (2 m K elements for 2 m^2 K flops), read again
        by every tile that shares them (from L2, at the loading warps' pace). Never more than
        the whole footprint: a tile stages each operand element through shared memory once."""
        share = self.bytes / self.tiles
        if self.written_bytes <= 0 or self.flops <= 0:
            return share
        side = math.sqrt(max(self.written_bytes / self.elem_bytes / self.tiles, 1.0))
        return max(share, min(self.bytes, self.flops / self.tiles / side * self.elem_bytes))
