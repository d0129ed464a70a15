"""A latency model of GPU time, per stage, per kernel and per inference, that measurement can check.

Why not a roofline: a stage's time depends on how its tiles fill the grid, not only on its
bytes and flops. The terms, each physical:

* **Waves and the idle tail.** A stage of ``tiles`` blocks runs on ``slots`` resident blocks
  (the co-resident blocks of a stitched kernel's grid; ``blocks per SM x SMs`` for a kernel of
  its own) in ``ceil(tiles / slots)`` waves; the last wave holds the remainder, and every SM
  waits for it at the next grid sync or kernel boundary.
* **Latency hiding.** A wave of ``a`` tiles keeps ``a x warps per tile`` warps loading; each
  has a bounded number of bytes in flight, so the wave's bandwidth is ``min(DRAM x
  mem_efficiency, warps x warp_gbps)`` (Little's law; ``mem_efficiency`` 0.8 is what streaming
  kernels reach, not fitted). Occupancy (registers and shared memory of the worst stage, imposed
  on all stages of a stitched kernel) bounds the warps.
* **L2 re-reads.** A contraction's tiles re-read operand panels: at the warps' pace, and no
  faster than L2 sustains (``l2_efficiency`` of ``GPU.l2_bandwidth``, not fitted) where the
  operands fit in L2, DRAM's where they do not.
* **The K-loop chain.** A block whose K loop loads a step into shared memory and waits at a
  barrier before computing on it cannot overlap its steps: per wave, its steps' waits
  (``kstep_cycles`` each, fitted: a global load's round trip and the barrier) plus its
  shared-memory wavefronts, counted from the kernel's TIR (``cost.tir_counts``) or given by the
  rule that tiled it. Register blocking shows here: one output per thread means one shared load
  per FMA, hence many wavefronts.
* **Coalescing.** A kernel's global requests move between L2 and the SMs a 32-byte sector at a
  time: the sectors counted from its TIR (``BlockCounts.global_sectors``; 32 a request where
  every lane reads another row, 4 for coalesced fp32) cross at ``l2_efficiency`` of L2's
  bandwidth, each active SM its share. L1 is credited only where the kernel's whole footprint
  fits in the L1 beside its blocks' shared memory (each SM then fetches it once); elsewhere
  ``l1_miss`` (1, not fitted) credits no L1 reuse: an upper bound on that traffic (a window
  re-read in a row hits L1 and is overpriced), a lower one where the static count misses requests.
* **Arithmetic** at the active SMs' share of the peak (tensor cores for stages that use them)
  times ``flop_efficiency`` (fixed at 0.9, not fitted), lower where an SM has too few warps to
  hide latency.
* **A round trip per wave.** However little a wave loads, its loads, arithmetic and stores
  depend on one another: it takes at least ``latency_us`` (a dependent trip to memory and
  back, and the stores made visible before whatever waits on them).
* **Grid-stride tiles.** In a stitched kernel a block runs its next tile of a stage only after
  its previous one (no other block's tile overlaps its start the way a new block does in a
  kernel of its own): ``tile_us`` per extra wave.
* **Waves.** Stages of one wave placed side by side on disjoint blocks (``stitch.waves``: a
  stacked recurrence's cells) run at once: the wave takes its slowest stage, not their sum
  (``Kernel.phases``; where their blocks would wrap around the grid they count in sequence).
  This is no fitted term, and no GPU has timed such a kernel yet.
* **Fixed costs.** A grid sync plus the cold restart after it (``sync_us``); per kernel in a
  CUDA graph (``node_us``); per launch from the host without a graph, which the GPU waits for
  when its kernels are shorter (``launch_us``).
* **Floors.** Neither a stage nor a kernel is predicted faster than its static floors
  (``cost.floors``: bytes over L2, flops on the busiest SM, shared-memory wavefronts, global
  sectors through the L1 data path (coalescing) and the K-step load chain counted from the
  kernel's TIR): fitted constants must not buy a time no schedule of that work can reach.

Seven constants, fitted once on every measured GPU run (``python/latency_fit.py``, results in
``data/latency/`` and docs/latency-model.md), shared by all models and operators. ``BEFORE``
is the model as it was before the sector term (the same code with it off). Not
modelled (said in the docs): L1 reuse of a window smaller than the footprint, L2 residency
between kernels (``Constants.l2_resident`` prices its bound instead: every streamed byte at L2's
rate; ``python/l2_residency.py``), bank conflicts, spills, instruction mix inside a tile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from . import floors
from .hardware import GPU, occupancy
from .work import SECTOR_BYTES, BlockCounts, Stage


@dataclass(frozen=True)
class Constants:
    """The model's constants: those in ``NAMES`` are fitted, ``mem_efficiency``,
    ``flop_efficiency`` and ``l2_efficiency`` fixed; ``RANGES`` gives each one's plausible
    physical range."""
    launch_us: float = 5.0          # host-side dispatch of one kernel launch without a graph
    node_us: float = 1.5            # one kernel in a CUDA graph: launch latency, ramp and drain
    sync_us: float = 2.0            # one grid.sync(), with the cold restart of every block after it
    mem_efficiency: float = 0.8     # of the DRAM datasheet bandwidth (not fitted: what a streaming kernel reaches)
    warp_gbps: float = 2.0          # GB/s one warp sustains (bytes in flight / memory latency)
    flop_efficiency: float = 0.9    # of the datasheet peak (not fitted: every fit and refit put it at 0.9, its bound)
    tile_us: float = 2.0            # a stitched stage's block starting its next tile (grid-stride): no overlap
    latency_us: float = 0.7         # the least one wave takes: dependent loads, arithmetic, stores made visible
    kstep_cycles: float = 400.0     # one unpipelined K step's wait: a global load's round trip and the barrier (0: off)
    l2_efficiency: float = 0.5      # of GPU.l2_bandwidth re-reads sustain (not fitted; 0: no L2 term)
    l1_miss: float = 1.0            # share of counted global sectors fetched from L2 (not fitted; 0: no sector term)
    l2_resident: bool = False       # a bound, not a form: every streamed byte at L2's rate (L2 residency between kernels at most)

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in NAMES}

    @classmethod
    def fitted_from(cls, values: dict) -> "Constants":
        """The fitted constants in ``values`` (``as_dict``'s form; other keys ignored), the rest default."""
        return cls(**{n: float(v) for n, v in values.items() if n in NAMES})


# Fitted by python/latency_fit.py on data/gpu runs 1-3 (data/latency/fit.json); a test
# checks these equal the committed fit. Each refit is its own commit.
FITTED = Constants(launch_us=8.068, node_us=0.7292, sync_us=1.711, tile_us=0.1190, warp_gbps=0.9175, latency_us=0.6975,
                   kstep_cycles=1921.0)

# The model before the sector term (the fourth form, fitted 2026-12-03 on the same runs): the same
# code with ``l1_miss`` 0; python/bench.py prices every kernel with both.
BEFORE = Constants(launch_us=8.041, node_us=0.5416, sync_us=1.226, tile_us=0.1, warp_gbps=0.6506, latency_us=0.6809,
                   kstep_cycles=2000.0, l1_miss=0.0)


NAMES = ("launch_us", "node_us", "sync_us", "tile_us", "warp_gbps", "latency_us", "kstep_cycles")
RANGES = {"launch_us": (1.0, 15.0), "node_us": (0.5, 5.0), "sync_us": (0.5, 8.0),
          "mem_efficiency": (0.4, 0.95), "tile_us": (0.1, 20.0), "warp_gbps": (0.2, 20.0), "flop_efficiency": (0.02, 0.9),
          "latency_us": (0.3, 2.0), "kstep_cycles": (floors.LOAD_LATENCY_CYCLES, 2000.0)}


@dataclass(frozen=True)
class Kernel:
    """One ``__global__`` function: its launch, resources and stages (one unless stitched)."""
    name: str
    grid: int
    threads: int
    registers: int | None
    shared_bytes: int
    stages: tuple[Stage, ...]
    grid_syncs: int = 0
    launches: int = 1
    uncaptured: int | None = None   # under TVM's CUDA-graph rewriting: launches left outside its graphs
    counts: BlockCounts | None = None   # what one block executes, from its lowered TIR
    phases: tuple[tuple[int, int], ...] | None = None   # per stage: (segment between grid syncs, lane)

    @classmethod
    def single(cls, name: str, grid: int, threads: int, registers: int | None, shared_bytes: int,
               bytes_: int, flops: int, tensor_core: bool = False, launches: int = 1) -> "Kernel":
        return cls(name, grid, threads, registers, shared_bytes,
                   (Stage(grid, threads, bytes_, flops, tensor_core),), 0, launches)


@dataclass(frozen=True)
class StageTime:
    waves: int
    tail: float          # idle fraction of the last wave's slots (0: the tiles fill it)
    memory_s: float
    compute_s: float
    seconds: float
    floor: float = 0.0   # the stage's largest static floor: ``seconds`` is never below it


@dataclass(frozen=True)
class KernelTime:
    name: str
    slots: int           # blocks resident at once
    blocks_per_sm: int
    stages: tuple[StageTime, ...]
    sync_s: float
    seconds: float       # one launch on the GPU, without launch costs
    floor: float = 0.0   # its static floor (the stages' floors in sequence, or what its blocks execute)
    floor_by: str | None = None


@dataclass(frozen=True)
class Prediction:
    seconds: float                   # one inference
    gpu_seconds: float               # the kernels' own time, no launch costs
    overhead_seconds: float          # what launches (or graph nodes) add on top
    kernels: list[KernelTime] = field(default_factory=list)


def stage_floors(gpu: GPU, stage: Stage, slots: int) -> dict[str, float]:
    """A stage's static floors (``cost.floors``) on ``slots`` resident blocks."""
    return floors.stage_floors(gpu, stage.tiles, stage.bytes, stage.flops, stage.tensor_core, stage.elem_bytes,
                               stage.shared_wavefronts, stage.k_steps, slots)


def stage_floor_seconds(gpu: GPU, stage: Stage, slots: int) -> float:
    """The largest of a stage's static floors."""
    return floors.binding(stage_floors(gpu, stage, slots))[1]


def resident_blocks(gpu: GPU, kernel: Kernel) -> tuple[int, int]:
    """(blocks per SM, slots): how many of the kernel's blocks run at once."""
    per_sm = (occupancy(gpu, kernel.threads, kernel.registers, kernel.shared_bytes).blocks_per_sm
              if kernel.registers is not None else max(1, gpu.threads_per_sm // max(kernel.threads, 1)))
    per_sm = max(per_sm, 1)     # a kernel that launched has at least one block per SM
    return per_sm, min(kernel.grid, per_sm * gpu.sms)


def wave_seconds(gpu: GPU, c: Constants, stage: Stage, active: int) -> tuple[float, float]:
    """(memory, compute) seconds of one wave of ``active`` tiles of ``stage``."""
    per_tile_flops = stage.flops / stage.tiles
    warps = active * math.ceil(stage.threads / gpu.warp_size)
    hiding = warps * c.warp_gbps * 1e9
    streaming = gpu.dram_bandwidth * c.mem_efficiency
    if c.l2_resident and c.l2_efficiency > 0:
        streaming = max(streaming, gpu.l2_bandwidth * c.l2_efficiency)
    dram = active * stage.bytes / stage.tiles / min(streaming, hiding)
    rereads = hiding
    if c.l2_efficiency > 0:
        rereads = min(hiding, gpu.l2_bandwidth * c.l2_efficiency if stage.bytes <= gpu.l2_bytes else streaming)
    memory = max(dram, active * stage.tile_loads() / rereads)
    peak = gpu.fp16_flops if stage.tensor_core else gpu.fp32_flops
    active_sms = min(active, gpu.sms)
    # the arithmetic pipes hide latency with the same warps: an SM with fewer warps than it takes
    # to saturate its share of DRAM runs its arithmetic that much below peak too
    saturating = gpu.dram_bandwidth * c.mem_efficiency / gpu.sms / (c.warp_gbps * 1e9)
    hidden = min(1.0, warps / active_sms / saturating)
    flops_rate = peak * c.flop_efficiency * active_sms / gpu.sms * hidden
    return memory, active * per_tile_flops / flops_rate


def chain_seconds(gpu: GPU, c: Constants, counts: BlockCounts, block_cycles: float = 0.0) -> float:
    """One block's K-loop chain: its unpipelined steps' waits (``kstep_cycles``), its pipelined
    steps' barriers and, between them, its shared-memory wavefronts and its arithmetic
    (``block_cycles``); 0 without steps or with the term off."""
    if c.kstep_cycles <= 0:
        return 0.0
    return counts.chain_cycles(c.kstep_cycles, block_cycles) / gpu.clock_hz


def block_cycles(gpu: GPU, kernel: "Kernel") -> float:
    """An average block's arithmetic alone on its SM (``floors.compute_cycles``)."""
    st = kernel.stages
    if not st or kernel.grid <= 0:
        return 0.0
    return floors.compute_cycles(gpu, sum(s.flops for s in st) / kernel.grid, any(s.tensor_core for s in st),
                                 st[0].elem_bytes)


def sector_seconds(gpu: GPU, c: Constants, kernel: "Kernel") -> float:
    """The kernel's global requests moved between L2 and its SMs a 32-byte sector at a time
    (``BlockCounts.global_sectors``, every block at least the counted one's): an uncoalesced
    load (a lane per row) moves eight times a coalesced fp32 load's bytes. Where the kernel's
    whole footprint fits in the L1 its SMs keep beside their blocks' shared memory, each active
    SM fetches it at most once and re-reads hit L1; else ``l1_miss`` of the sectors come from L2
    (1: no L1 reuse credited). They cross at ``l2_efficiency`` of L2's bandwidth, each active SM
    at most its share of it; 0 without counts or with the term off. A kernel's busiest block
    moves its own sectors through its one SM: a stage of two tiles in a 132-block kernel
    takes what those two blocks take, as the partitioner prices it (``stage_time``: its tiles
    are the active blocks)."""
    counts = kernel.counts
    if counts is None or not counts.global_sectors:
        return 0.0
    per_sm, _ = resident_blocks(gpu, kernel)
    footprint = sum(s.bytes for s in kernel.stages)
    l1_left = gpu.l1_shared_per_sm - per_sm * kernel.shared_bytes
    seconds = _sectors_seconds(gpu, c, counts.global_sectors * kernel.grid, kernel.grid, footprint, l1_left)
    if counts.busiest is not None:
        seconds = max(seconds, _sectors_seconds(gpu, c, counts.busiest.global_sectors, 1, footprint, l1_left))
    return seconds


def _sectors_seconds(gpu: GPU, c: Constants, sectors: float, blocks: int, footprint: int, l1_left: int) -> float:
    """``sectors`` of ``blocks`` blocks from L2 (``sector_seconds``); ``l1_left``: the L1 an SM
    keeps beside its blocks' shared memory."""
    if c.l1_miss <= 0 or c.l2_efficiency <= 0 or sectors <= 0:
        return 0.0
    moved = c.l1_miss * sectors * SECTOR_BYTES
    active = min(blocks, gpu.sms)
    if footprint <= l1_left:
        moved = min(moved, footprint * active)
    return moved / (gpu.l2_bandwidth * c.l2_efficiency * active / gpu.sms)


def stage_time(gpu: GPU, c: Constants, stage: Stage, slots: int, persistent: bool = False,
               chain_s: float | None = None) -> StageTime:
    """A stage's tiles over ``slots`` resident blocks: full waves, then the remainder; each wave
    at least ``latency_us`` and its blocks' K-loop chain (``chain_s``, else from the stage's own
    ``k_steps``), and in a ``persistent`` (stitched) kernel ``tile_us`` per extra wave."""
    if stage.tiles <= 0 or (stage.bytes <= 0 and stage.flops <= 0):
        return StageTime(0, 0.0, 0.0, 0.0, 0.0)
    waves = math.ceil(stage.tiles / slots)
    full, rest = divmod(stage.tiles, slots)
    if chain_s is None:
        chain_s = chain_seconds(gpu, c, BlockCounts(stage.threads, stage.shared_wavefronts, stage.k_steps),
                                floors.compute_cycles(gpu, stage.flops / stage.tiles, stage.tensor_core,
                                                      stage.elem_bytes))
    mem = comp = seconds = 0.0
    for active, count in ((slots, full), (rest, 1 if rest else 0)):
        if count:
            m, f = wave_seconds(gpu, c, stage, active)
            mem, comp = mem + count * m, comp + count * f
            seconds += count * max(m, f, c.latency_us * 1e-6, chain_s)
    tail = (slots - rest) / slots if rest else 0.0
    if persistent:
        seconds += (waves - 1) * c.tile_us * 1e-6
    # the stage's own sectors (the partitioner's, and a stitched kernel's stage plan): its tiles are
    # the blocks that move them, which the kernel's whole-block counts cannot say
    seconds = max(seconds, _sectors_seconds(gpu, c, stage.sectors * stage.tiles, stage.tiles, stage.bytes,
                                            gpu.l1_shared_per_sm))
    floor = stage_floor_seconds(gpu, stage, slots)
    return StageTime(waves, tail, mem, comp, max(seconds, floor), floor)


def kernel_time(gpu: GPU, c: Constants, kernel: Kernel) -> KernelTime:
    """One launch of ``kernel``: its stages one after another, each after its grid sync."""
    per_sm, slots = resident_blocks(gpu, kernel)
    counted = kernel.counts
    cycles = block_cycles(gpu, kernel)
    # the average block's arithmetic is in the busiest block's chain, or every block's where all count alike
    chain = chain_seconds(gpu, c, counted, 0.0 if counted.busiest else cycles) if counted is not None else 0.0
    single = len(kernel.stages) == 1
    stages = tuple(stage_time(gpu, c, s, slots, persistent=not single,
                              chain_s=chain if single and counted is not None else None) for s in kernel.stages)
    sync = kernel.grid_syncs * c.sync_us * 1e-6
    seconds = in_phases(kernel, [s.seconds for s in stages]) + sync
    if not single and counted is not None:
        # the counts are the whole kernel's (every stage's steps of one block), one wave per slot
        # fill; and no kernel ends before its busiest block's chain
        seconds = max(seconds, math.ceil(kernel.grid / max(slots, 1)) * chain)
    if counted is not None and counted.busiest is not None:
        seconds = max(seconds, chain_seconds(gpu, c, counted.busiest, cycles))
    seconds = max(seconds, sector_seconds(gpu, c, kernel))
    by, floor = kernel_floor(gpu, kernel, slots, stages)
    return KernelTime(kernel.name, slots, per_sm, stages, sync, max(seconds, floor), floor, by)


def in_phases(kernel: Kernel, values: list[float]) -> float:
    """Per-stage figures added up in sequence, except that in a segment between grid syncs the
    lanes (``Kernel.phases``: a wave's chains on disjoint blocks, ``stitch.waves``) run at
    once: a segment takes its slowest lane's sum."""
    if not kernel.phases:
        return sum(values)
    lanes: dict = {}
    for (segment, lane), v in zip(kernel.phases, values):
        lanes[(segment, lane)] = lanes.get((segment, lane), 0.0) + v
    slowest: dict = {}
    for (segment, _), v in lanes.items():
        slowest[segment] = max(slowest.get(segment, 0.0), v)
    return sum(slowest.values())


def kernel_floor(gpu: GPU, kernel: Kernel, slots: int, stages: tuple[StageTime, ...]) -> tuple[str | None, float]:
    """(name, seconds) of ``kernel``'s binding floor: its stages' floors one after another with
    its grid syncs', or a floor of what its blocks execute (``Kernel.counts``), whichever is larger."""
    named = {}
    if len(stages) == 1:
        named = stage_floors(gpu, kernel.stages[0], slots)
    elif stages:
        named = {"stages": in_phases(kernel, [s.floor for s in stages])
                 + kernel.grid_syncs * floors.GRID_SYNC_CYCLES / gpu.clock_hz}
    if kernel.counts is not None:
        for name, v in floors.block_floors(gpu, kernel.grid, slots, kernel.counts, block_cycles(gpu, kernel)).items():
            named[name] = max(named.get(name, 0.0), v)
    return floors.binding(named)


def predict(gpu: GPU, c: Constants, kernels: list[Kernel], graphs: bool, replays: int | None = None) -> Prediction:
    """One inference: every kernel's launches in order, under a CUDA graph or launched one by one.

    Under a graph each kernel costs ``node_us`` on top of its own time. Without one, the host
    needs ``launch_us`` per dispatch (the VM's call, then each launch) and the GPU waits for
    it when the kernel is shorter. ``replays`` (TVM's CUDA-graph rewriting, with ``graphs``
    False): that many graph launches from the host, and each kernel's ``uncaptured`` launches
    from the host, the rest inside the graphs.
    """
    times = [kernel_time(gpu, c, k) for k in kernels]
    busy = sum(k.launches * t.seconds for k, t in zip(kernels, times))
    node, launch = c.node_us * 1e-6, c.launch_us * 1e-6
    if graphs:
        total = sum(k.launches * (t.seconds + node) for k, t in zip(kernels, times))
    elif replays is not None:
        total = launch * (1 + replays)
        for k, t in zip(kernels, times):
            out = k.launches if k.uncaptured is None else min(k.uncaptured, k.launches)
            total += out * max(launch, t.seconds + node) + (k.launches - out) * (t.seconds + node)
    else:
        total = launch + sum(k.launches * max(launch, t.seconds + node) for k, t in zip(kernels, times))
    return Prediction(total, busy, total - busy, times)


def _prod(dims) -> int:
    return math.prod(dims) if dims else 1


def kernels_from_rows(rows: list[dict], elem_bytes: int = 4) -> list[Kernel]:
    """Kernels from report rows (``Report.kernels`` as JSON, or the replayed plans of
    ``data/latency/``): a row with ``stages`` given as dicts is a stitched kernel.
    ``elem_bytes``: the element size where a row does not give its own."""
    out = []
    for r in rows:
        grid, threads = _prod(r["grid"]), _prod(r["block"])
        plan = r.get("stage_plan") or (r.get("stages") if r.get("stages") and isinstance(r["stages"][0], dict) else None)
        if plan:
            stages = tuple(Stage(s["tiles"], s["threads"], s["bytes"], s["flops"], bool(s.get("tensor_core")),
                                 s.get("written_bytes") or 0, s.get("elem_bytes") or r.get("elem_bytes") or elem_bytes,
                                 s.get("shared_wavefronts") or 0.0, s.get("k_steps") or 0, s.get("sectors") or 0.0)
                           for s in plan)
            phases = tuple(tuple(s["phase"]) for s in plan) if all("phase" in s for s in plan) else None
            out.append(Kernel(r["name"], grid, threads, r.get("registers"), r.get("shared_bytes") or 0, stages,
                              r.get("grid_syncs") or 0, r["launches"], r.get("launches_outside_graph"),
                              _counts(r), phases))
        else:
            st = Stage(grid, threads, r["bytes"], r["flops"], bool(r.get("tensor_core")),
                       r.get("written_bytes") or 0, r.get("elem_bytes") or elem_bytes)
            out.append(Kernel(r["name"], grid, threads, r.get("registers"), r.get("shared_bytes") or 0, (st,), 0,
                              r["launches"], r.get("launches_outside_graph"), _counts(r)))
    return out


# What ``kernels_from_rows`` reads of a report row: a kernel's inputs to the model, enough to price
# it again under other constants (``python/latency_fit.py`` fits on measured kernels with them).
ROW_INPUTS = ("name", "grid", "block", "registers", "shared_bytes", "launches", "bytes", "flops", "tensor_core",
              "written_bytes", "elem_bytes", "stage_plan", "grid_syncs", "launches_outside_graph", "block_counts")


def row_inputs(row: dict) -> dict:
    """The fields of a report row (``asdict(KernelReport)``) the model prices it from: the
    ``kernels_from_rows`` of the result prices it as the report did."""
    return {f: row[f] for f in ROW_INPUTS if row.get(f) is not None}


def _counts(row: dict) -> BlockCounts | None:
    c = row.get("block_counts")
    return BlockCounts.from_dict(c) if c else None
