"""The settings of one compile, checked once.

``level`` selects the paper's ablation level by leaving passes out by name (``LEVEL_DISABLES``):
v0 no transforms, v1 + horizontal, v2 + vertical (one kernel per anchor group, no grid sync),
v3 + two-phase reductions and stitching (each subprogram of groups becomes ONE cooperative
kernel with grid syncs; CUDA only: on llvm, the CPU twin, v3 builds the same groups as loop
nests), v4 + each stitched kernel prefetches the inputs of its next segment into L2 before the
grid sync that precedes it (on llvm v4 is v3). ``auto``, the default of ``compile`` and the
command line: v3 with the time-driven partitioner (on llvm its CPU twin), and on CUDA the
build the latency model predicts faster of that and TVM's own (``pipeline.driver``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import tvm

from ..core.geometry import MATMUL_MICROS, MATMUL_THREADS
from ..core.targets import is_cuda
from ..errors import OptionsError

FUSIONS = ("tvm", "souffle")
PARTITIONERS = ("budget", "time", "blocks")
REDUCTIONS = ("deterministic", "atomic")
GEMM_TILES = tuple(MATMUL_THREADS * m for m in sorted(MATMUL_MICROS))   # 16, 32, 64

# The passes (by name) each level leaves out (``passes.SoufflePipeline`` reads it; stitching and
# the prefetch are CUDA's alone, whatever the level).
_STITCH = ["souffle.StitchSubprograms", "souffle.PlantPrefetch"]
LEVEL_DISABLES = {"v0": ["souffle.HorizontalFusion", "souffle.VerticalFusion", "souffle.TwoPhaseReduction", *_STITCH],
                  "v1": ["souffle.VerticalFusion", "souffle.TwoPhaseReduction", *_STITCH],
                  "v2": ["souffle.TwoPhaseReduction", *_STITCH], "v3": ["souffle.PlantPrefetch"], "v4": []}
LEVELS = tuple(LEVEL_DISABLES)
AUTO = "auto"
STITCHING_LEVELS = ("v3", "v4")


@dataclass(frozen=True)
class Options:
    """How to compile. ``gemm_k_tile``: the K tile of stitched SIMT GEMM stages (v3, CUDA;
    default: per GEMM, 16, 32 or 64, the one the latency model predicts fastest where its shared
    memory costs no resident block; tiles over 48 KB of shared memory go to dynamic shared memory). ``gemm_tile``: their output
    tile side, 16, 32 or 64 (default: per GEMM, the one whose tile count the latency model
    predicts fills the stitched grid best). ``partitioner`` (v3):
    "budget", resource-aware (as many groups as fit), "time", resource-aware and stitching only
    where the latency model predicts one kernel faster than separate kernels under a CUDA graph,
    or "blocks", a subprogram per attention / FFN block.
    ``reduction`` (v3): two-phase reductions with a partial buffer and a combine
    ("deterministic") or, for fp32 sums on CUDA, with atomicAdd ("atomic"). ``database``: a
    directory written by ``souffle-tvm tune`` (souffle fusion). ``nvcc``: measure registers and
    shared memory with ptxas where nvcc exists (and let them correct the partition). ``onchip``
    (v3): a stitched kernel keeps a block-local intermediate in shared memory (``stitch.channel``)
    instead of global memory, a row chain (``te.chains``: attention) is one kernel holding its
    rows on chip, a prologue or a window chain (``partition.kernels``) keeps its tensor in the
    consuming GEMM's or window's shared memory, and a weight several stages re-read is copied into each block's shared memory
    once (``stitch.resident``: an LSTM layer's recurrent weights); off, every intermediate and
    weight goes through global memory (to compare). ``waves`` (v3/v4 with the budget
    partitioner, CUDA): a stacked recurrence as a wavefront, its step takes moved to the concats
    they read (``transforms.step_slices``) so that cell (l, t) shares its waves with (l-1, t+1)
    (``stitch.waves``); off by default while a wave kernel's first and last waves stay written
    out (deep stacks keep the layer order, whose steps roll)."""

    fusion: str = "souffle"
    level: str = "v2"
    partitioner: str | None = None     # None: "time" at level auto, else "budget"
    reduction: str = "deterministic"
    gemm_k_tile: int | None = None
    database: str | None = None
    nvcc: bool = True
    gemm_tile: int | None = None
    onchip: bool = True
    waves: bool = False

    def resolved(self) -> "Options":
        """``auto`` as the level it stands for (v3, time-driven unless a partitioner is given)."""
        if self.level == AUTO:
            return replace(self, level="v3", partitioner=self.partitioner or "time")
        return self if self.partitioner is not None else replace(self, partitioner="budget")

    def check(self, target: tvm.target.Target) -> "Options":
        """The options with ``auto`` resolved; raise an OptionsError naming the first setting that
        does not exist or apply."""
        if self.level == AUTO or self.partitioner is None:
            return self.resolved().check(target)
        for name, value, allowed in (("fusion", self.fusion, FUSIONS), ("level", self.level, LEVELS + (AUTO,)),
                                     ("partitioner", self.partitioner, PARTITIONERS),
                                     ("reduction form", self.reduction, REDUCTIONS)):
            if value not in allowed:
                raise OptionsError(f"unknown {name} {value!r}; available: {', '.join(allowed)}")
        if self.gemm_tile not in (None, *GEMM_TILES):
            raise OptionsError(f"unknown GEMM tile {self.gemm_tile!r}; available: {', '.join(map(str, GEMM_TILES))}")
        if self.reduction == "atomic" and not is_cuda(target):
            raise OptionsError("atomic two-phase reductions are a CUDA option (the CPU twin is deterministic)")
        if self.database is not None and self.fusion != "souffle":
            raise OptionsError("--database applies tuned Souffle stages: use it with --fusion souffle")
        if self.waves and not (self.stitches(target) and self.partitioner == "budget"):
            raise OptionsError("waves (a stacked recurrence as a wavefront) apply to stitched kernels: "
                               "--level v3 or v4 on CUDA, with the budget partitioner")
        return self

    def stitches(self, target: tvm.target.Target) -> bool:
        """Whether subprograms become cooperative kernels (v3/v4 on CUDA)."""
        return self.level in STITCHING_LEVELS and is_cuda(target)

    def step_slices(self, target: tvm.target.Target) -> bool:
        """Whether step takes move to the concats they read (``transforms.step_slices``), so a
        stacked recurrence's cells can form waves: with ``waves``, where stitching partitions by
        budget (the time-driven partitioner does not price a kernel's waves yet, and would cut
        the per-step input projections into kernels of their own)."""
        return self.waves and self.stitches(target) and self.partitioner == "budget"


@dataclass(frozen=True)
class Feedback:
    """What a build with ptxas told the stitcher, for the next stitch of the same groups.

    ``forced``: group position -> why a boundary must follow it (a kernel spilled or could not
    be co-resident). ``grids``: stitched kernel name -> blocks to launch (None: from the static
    estimate when ``estimated_grids``, a build then checks them, else one block per SM, which is
    co-resident whenever a block fits at all). ``no_prefetch``: V4 kernels to stitch without
    their L2 prefetch (they did not fit with it). ``min_blocks``: stitched kernel name -> its
    register cap, as blocks per SM (``__launch_bounds__``). ``partition_block``: subprograms
    (their group positions, as tuples) stitched at the partition's block size whatever the
    model prefers (they did not fit at the size it chose: ``partition.block_choice``)."""

    forced: dict = field(default_factory=dict)
    grids: dict | None = None
    estimated_grids: bool = False
    no_prefetch: frozenset = frozenset()
    min_blocks: dict = field(default_factory=dict)
    partition_block: frozenset = frozenset()
