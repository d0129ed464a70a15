"""What a build is: the typed facts the ptxas feedback loop prices and the report renders once.

Per device kernel (``KernelFacts``) its launch, ptxas' figures, bytes and flops, what one block
executes, and for a stitched kernel its stages' plan: per stage the ``cost.work.Stage`` the
latency model prices, with the bytes its on-chip channels keep off the global memory. Made from
plain data: the ``BuildResult`` of ``build.executable``, the figures of ``build.ptxas`` and the
``StitchedKernel`` s of ``stitch.module``. ``cost_kernels`` hands them to the latency model as
they are; nothing here decides.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from tvm import tirx

from ..cost import latency, tir_stats
from ..cost.hardware import for_arch, occupancy
from ..cost.work import BlockCounts, Stage
from ..errors import CoresidencyError
from ..stitch.module import function_runs
from .executable import BuildResult, DeviceKernel


@dataclass(frozen=True)
class PlannedStage:
    """One stage of a stitched kernel as the latency model prices it, and the bytes it reads or
    writes on chip instead of through global memory (its channels; 0 where none)."""
    stage: Stage
    onchip_bytes: int = 0


@dataclass
class KernelFacts:
    """One ``__global__`` function as built (the field names are the report row's)."""
    name: str
    primfunc: str
    grid: list[int] | None
    block: list[int] | None
    registers: int | None
    shared_bytes: int | None          # static from ptxas + dynamic from the TIR
    spill_bytes: int | None
    launches: int
    bytes: int                        # compulsory global traffic of one launch
    flops: int
    cooperative: bool = False
    tensor_core: bool = False
    written_bytes: int | None = None
    elem_bytes: int | None = None
    counts: BlockCounts | None = None          # what one block executes (as kept: 2 decimals)
    max_coresident: int | None = None          # cooperative kernels: blocks that fit at once
    launches_outside_graph: int | None = None  # built with CUDA graphs: launches left outside them
    # stitched kernels
    stages: list[str] | None = None
    grid_syncs: int | None = None
    prefetched_bytes: int | None = None
    min_blocks: int | None = None
    stage_plan: list[PlannedStage] | None = None
    on_chip: dict | None = None
    phases: list[tuple[int, int]] | None = None   # per stage: (segment between grid syncs, lane) (``stitch.waves``)

    def cost_kernel(self) -> latency.Kernel:
        """The latency model's kernel: a stitched kernel's planned stages, else one stage of its
        own launch, bytes and flops."""
        grid, threads = math.prod(self.grid or ()), math.prod(self.block or ())
        if self.stage_plan:
            # a stage that stores nothing of its own is priced at the kernel's element size
            stages = tuple(p.stage if p.stage.elem_bytes else dataclasses.replace(p.stage, elem_bytes=self.elem_bytes or 4)
                           for p in self.stage_plan)
        else:
            stages = (Stage(grid, threads, self.bytes, self.flops, self.tensor_core, self.written_bytes or 0,
                            self.elem_bytes or 4),)
        return latency.Kernel(self.name, grid, threads, self.registers, self.shared_bytes or 0, stages,
                              (self.grid_syncs or 0) if self.stage_plan else 0, self.launches,
                              self.launches_outside_graph, self.counts,
                              tuple(self.phases) if self.stage_plan and self.phases else None)


@dataclass
class BuildFacts:
    """A whole build: its kernels in launch order, and whether ptxas gave their figures."""
    model: str
    target: str                       # "cuda" / "llvm"
    arch: str | None
    kernels: list[KernelFacts]
    distinct: int                     # distinct ``__global__`` functions (on llvm: PrimFuncs)
    seconds: float
    nvcc: dict = field(default_factory=dict)   # {available, seconds, note}

    def cost_kernels(self) -> list[latency.Kernel]:
        return [k.cost_kernel() for k in self.kernels]

    def graph_seconds(self, constants: latency.Constants = latency.FITTED) -> float:
        """Predicted time of one inference under a CUDA graph (an estimate)."""
        return latency.predict(for_arch(self.arch or "sm_90"), constants, self.cost_kernels(), graphs=True).seconds

    def spills(self) -> int:
        """Bytes of register spills over the cooperative kernels."""
        return sum(k.spill_bytes or 0 for k in self.kernels if k.cooperative)

    def coresident(self) -> bool:
        """Whether every cooperative grid fits on the GPU at once."""
        try:
            check_coresidency(self)
            return True
        except CoresidencyError:
            return False


def _kernel_flops(kernels: list[DeviceKernel], flops: dict[str, int]) -> list[int]:
    """Split a PrimFunc's block flops over its kernels by which kernel stores each block's buffer."""
    if len(kernels) <= 1:         # none: a function that launches nothing (``NothingToWrite``)
        return [sum(flops.values())] if kernels else []
    out = [0] * len(kernels)
    for buf, f in flops.items():
        owner = next((i for i, k in enumerate(kernels) if buf in k.stored), 0)
        out[owner] += f
    return out


def _kernel_bytes(kernel: DeviceKernel, footprint: dict) -> int:
    """Compulsory traffic of one launch: each global buffer's accessed footprint (``footprint``:
    parameter position -> bytes; whole size where the unscheduled TIR has no region for it,
    e.g. scheduler-made temporaries)."""
    return sum(min(footprint.get(key, size), size) for key, size in kernel.global_buffers.items())


def cuda_facts(name: str, target, result: BuildResult, figures: dict | None, nvcc: dict,
               stitched: list = (), unstitched=None) -> BuildFacts:
    """Per device kernel its launch, ptxas figures (``figures``: kernel name -> resources, None
    without nvcc), bytes and flops, each cooperative kernel's co-resident limit, and each
    stitched kernel's stages (``stitched``; ``unstitched``: the module holding their stage
    PrimFuncs); ``nvcc``: {available, seconds, note}."""
    by_func: dict[str, list[DeviceKernel]] = {}
    for k in result.kernels:
        by_func.setdefault(k.primfunc, []).append(k)
    kernels = []
    for pf, calls in result.calls.items():
        ks = by_func.get(pf, [])
        for k, fl in zip(ks, _kernel_flops(ks, result.flops.get(pf, {}))):
            r = figures.get(k.name) if figures else None
            kernels.append(KernelFacts(
                k.name, pf, k.grid, k.block, r.registers if r else None,
                (r.shared_bytes if r else 0) + k.dyn_shared_bytes if (r or not figures) else None,
                r.spill_bytes if r else None, calls, _kernel_bytes(k, result.footprints.get(pf, {})), fl,
                cooperative=k.cooperative, tensor_core=k.tensor_core,
                written_bytes=sum(min(result.footprints.get(pf, {}).get(n, v), v)
                                  for n, v in k.global_buffers.items() if n in k.stored),
                elem_bytes=k.elem_bytes, counts=k.counts.rounded() if k.counts else None))
    distinct = len({k.name for k in result.kernels if k.primfunc in result.calls})
    facts = BuildFacts(name, "cuda", str(target.attrs["arch"]), kernels, distinct, result.seconds, nvcc)
    _add_stitched(facts, result, stitched, unstitched)
    check_coresidency(facts, raise_=False)
    return facts


def cpu_facts(name: str, result: BuildResult, stitched: list = (), unstitched=None) -> BuildFacts:
    """Per PrimFunc its calls, bytes and flops (the CPU twin has no launches), and each stitched
    function's stages as on CUDA."""
    funcs = {gv.name_hint: f for gv, f in result.fused.functions.items() if isinstance(f, tirx.PrimFunc)}
    kernels = [KernelFacts(pf, pf, None, None, None, None, None, calls,
                           sum(result.footprints.get(pf, {}).values()) or tir_stats.primfunc_param_bytes(funcs[pf]),
                           sum(result.flops.get(pf, {}).values()))
               for pf, calls in result.calls.items()]
    facts = BuildFacts(name, "llvm", None, kernels, len(kernels), result.seconds,
                       {"available": False, "seconds": 0.0, "note": "CPU target"})
    _add_stitched(facts, result, stitched, unstitched)
    return facts


def add_stitched_work(result: BuildResult, stitched: list) -> None:
    """A stitched kernel does its stages' work and moves their traffic (intermediates included:
    without two-phase reductions they still pass through global memory)."""
    for k in stitched:
        # Once per call: a function called many times (an LSTM's GEMV) counts each time, and a
        # function lowered to several launch regions counts once (its first region).
        calls = [st.function for st in k.stage_ids if st.region in (None, 0)]
        result.flops[k.function] = {f"{i}:{st}:{b}": f for i, st in enumerate(calls)
                                    for b, f in result.flops.get(st, {}).items()}
        # keyed by (stage, parameter position): every stage's buffers counted, none merged
        result.footprints[k.function] = {f"{i}:{pos}": v for i, st in enumerate(calls)
                                         for pos, v in result.footprints.get(st, {}).items()}


def check_coresidency(facts: BuildFacts, raise_: bool = True) -> None:
    """A cooperative grid must fit on the GPU at once, or grid.sync() deadlocks: refuse the build
    (or, with ``raise_=False``, only fill in each kernel's co-resident limit)."""
    gpu = for_arch(facts.arch or "sm_90")
    for k in facts.kernels:
        if not k.cooperative or k.registers is None:
            continue
        occ = occupancy(gpu, k.block[0] * k.block[1] * k.block[2], k.registers, k.shared_bytes or 0)
        k.max_coresident = occ.max_coresident(gpu)
        blocks = k.grid[0] * k.grid[1] * k.grid[2]
        if raise_ and blocks > k.max_coresident:
            raise CoresidencyError(f"{k.name}: a grid of {blocks} blocks cannot be co-resident on {gpu.name} "
                                   f"(at most {k.max_coresident}: {occ.blocks_per_sm}/SM, limited by {occ.limited_by})")


def _add_stitched(facts: BuildFacts, result: BuildResult, stitched: list, unstitched) -> None:
    """Each stitched kernel's stages, grid syncs, prefetch, register cap, own bytes (its stages'
    footprints) and stage plan: what the latency model reads."""
    if not stitched:
        return
    stage_funcs = {gv.name_hint: f for gv, f in unstitched.functions.items()
                   if isinstance(f, tirx.PrimFunc)} if unstitched is not None else {}
    for kf in facts.kernels:
        sk = next((k for k in stitched if k.function == kf.primfunc), None)
        if sk is not None:
            kf.stages, kf.grid_syncs = sk.stages, sk.grid_syncs
            kf.prefetched_bytes = sk.prefetched_bytes or None
            kf.min_blocks = sk.min_blocks
            kf.stage_plan = stage_plan(result, sk, stage_funcs)
            # where some segment runs lanes side by side (``stitch.waves``)
            kf.phases = [tuple(p) for p in sk.phases] if any(lane for _, lane in sk.phases) else None
            kf.bytes = sum(p.stage.bytes for p in kf.stage_plan)     # its stages' footprints
            kf.on_chip = {"stages": sum(bool(p) for p in sk.onchip), "channel_bytes": sk.onchip_bytes,
                          "resident_inputs": list(sk.resident_inputs), "resident_bytes": sk.resident_bytes,
                          "saved_bytes": sum(p.onchip_bytes for p in kf.stage_plan)}


def stage_plan(result: BuildResult, sk, stage_funcs: dict) -> list[PlannedStage]:
    """Per stage of stitched kernel ``sk``: the tiles and threads it would launch as a kernel of its
    own, its bytes and flops (a stage function lowered to several launch regions counts them,
    and the global scratch it passes between them, on its first), and whether it runs on
    tensor cores. Bytes are those leaving the chip: a tensor a stage reads from (or writes only
    to) an on-chip channel counts in its ``onchip_bytes`` instead."""
    plan = []
    run_of = {run[0]: run for run in function_runs(sk.stage_ids)}
    for i, (st, geometry) in enumerate(zip(sk.stage_ids, sk.geometry)):
        first = st.region in (None, 0)
        func = sk.stage_func(st.function, stage_funcs)
        # a function lowered to several launch regions passes data between them in global scratch
        scratch = tir_stats.global_scratch_bytes(func) if func is not None and st.region == 0 else 0
        nbytes = sum(result.footprints.get(st.function, {}).values()) + scratch if first else 0
        flops = sum(result.flops.get(st.function, {}).values()) if first else 0
        stage = (tir_stats.work_stages(func, [geometry], nbytes, flops)[0] if func is not None
                 else Stage(*geometry, nbytes, flops))
        # the function's first region carries its bytes: every region's on-chip reads come off there
        run = run_of.get(i, [i]) if first and func is not None else []
        # a resident input's first reader reads what its fill copies, not its own footprint of it
        filled = {pos: b for j in run for pos, b in (sk.filled[j] if j < len(sk.filled) else {}).items()}
        onchip = sorted({pos for j in run for pos in (sk.onchip[j] if j < len(sk.onchip) else [])} - set(filled))
        footprint = result.footprints.get(st.function, {})
        # a position past the parameters is a global scratch buffer between the function's kernels
        scratch = tir_stats.global_scratch_buffers(func) if onchip else []
        saved = sum(footprint.get(pos, tir_stats.buffer_bytes(func.params[pos])) if pos < len(func.params)
                    else tir_stats.buffer_bytes(scratch[pos - len(func.params)])
                    for pos in onchip if pos - len(func.params) < len(scratch))
        unwritten = sum(tir_stats.buffer_bytes(func.params[pos]) for pos in onchip
                        if pos in tir_stats.stored_positions(func)) if onchip else 0
        refill = sum(b - footprint.get(pos, tir_stats.buffer_bytes(func.params[pos])) for pos, b in filled.items())
        stage = dataclasses.replace(stage, bytes=stage.bytes - saved + refill,
                                    written_bytes=max(stage.written_bytes - unwritten, 0))
        if not first:      # only a function's first region carries what it stores
            stage = dataclasses.replace(stage, written_bytes=0)
        stage = _with_counts_alone(stage, sk.counted_alone[i] if i < len(sk.counted_alone) else None, saved - refill)
        plan.append(PlannedStage(stage, saved))
    return plan


def _with_counts_alone(stage: Stage, alone: dict | None, onchip: int) -> Stage:
    """``stage`` with what a block of it executes as the partitioner counted it (``alone``: the
    stage stitched alone at the kernel's block size), where the tiles are the same: a stitched
    kernel's own counts are of its busiest and last blocks, all stages together, so a stage of few
    tiles and many sectors is priced as those tiles' SMs move them, as the partitioner priced it.
    Global sectors scale with the bytes left off chip (``onchip``: what its channels took, less
    what a resident input's fill reads instead: a fill's loads are sectors too), as the
    partitioner's on-chip credit scales them. A stage whose tiles differ keeps the kernel's counts
    alone (no rule tiles a stage differently stitched today)."""
    if alone is None or alone["tiles"] != stage.tiles:
        return stage
    counted = dataclasses.replace(stage, sectors=alone["sectors"], k_steps=alone["k_steps"],
                                  shared_wavefronts=alone["shared_wavefronts"])
    if onchip <= 0:
        return counted
    return dataclasses.replace(counted, bytes=stage.bytes + onchip).read_on_chip(onchip)
