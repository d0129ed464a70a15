"""The Report: what a compiled model costs, per kernel and per inference.

JSON schema (``schema_version`` 1; other issues add fields, none are renamed):

=================  ==========================================================================
model              model name (file stem or zoo name)
target, arch       ``cuda`` / ``llvm``; ``sm_90`` etc. (null on llvm)
fusion             ``tvm`` or ``souffle``
launches           kernel launches per inference (on llvm: PrimFunc calls)
distinct_kernels   distinct ``__global__`` functions (on llvm: distinct PrimFuncs)
compile_seconds    wall time of the build (import excluded; nvcc excluded, see ``nvcc``)
bytes, flops       per inference: Σ launches × kernel bytes / flops
nvcc               {available, seconds, note}: whether resource figures come from ptxas
level              souffle only: the pipeline level (v0 none, v1 + horizontal, v2 + vertical,
                   v3 + two-phase reductions and stitched kernels, v4 + L2 prefetch)
groups[]           souffle only: per kernel group its name, members, and ``reason`` (why a
                   boundary was drawn before it); ``fallback`` says why TVM's path was used
group_edges[]      souffle only: the group DAG, ``[producer, consumer]`` indices into
                   ``groups`` (a consumer reads something the producer writes)
subprograms[]      v3/v4 only: the groups stitched into one cooperative kernel (``groups``: their
                   names; ``indices``: their positions in ``groups``), and ``reason`` (why the
                   subprogram ends where it does); ``block`` and ``block_reason`` where its
                   stitched kernel runs at another block size than the partition's 256 threads
kernels[]          name, primfunc, grid [x,y,z], block [x,y,z], registers, shared_bytes
                   (static from ptxas + dynamic from TIR), spill_bytes, launches (per
                   inference), bytes (compulsory global traffic of one launch: the sizes of the
                   global buffers it touches), flops (useful float ops of one launch, counted on
                   the unscheduled TIR, padding excluded); stitched kernels (v3) also
                   carry ``stages``, ``grid_syncs`` and ``cooperative``; with a tuning
                   database, ``schedule`` ("database" or "default: <rule>"; stitched kernels
                   count their stages) and ``schedule_note`` (why a record was not used);
                   ``tensor_core``, ``written_bytes``, ``elem_bytes``; stitched kernels
                   ``stage_plan`` (per stage: tiles and threads it would launch alone, bytes,
                   written_bytes, flops, tensor_core, elem_bytes), what the latency model reads;
                   ``min_blocks`` where the kernel's registers are capped (``__launch_bounds__``);
                   ``counted`` where the kernels were run in the emulator (``souffle-tvm compile
                   --count-traffic``, small models): distinct_bytes (each byte read or written
                   once), written_bytes, warp requests, 32-byte sectors and sectors_per_request
                   (4 for coalesced fp32, 32 when each lane reads another row), sectors_exact,
                   shared_accesses, calls; stitched kernels per stage too (``stages``)
cuda_graph         built with ``--cuda-graph`` (TVM's ``relax.backend.use_cuda_graph``): graph
                   ``replays``, ``captured_launches`` and ``launches_outside`` per inference;
                   each kernel's ``launches_outside_graph``
latency            CUDA only: the latency model's prediction (cost/latency.py; an estimate,
                   never a measurement): ``ms`` launched one by one, ``graph_ms`` under a CUDA
                   graph, ``gpu_ms`` the kernels alone, ``rewrite_ms`` as built with TVM's CUDA-graph
                   rewriting (``cuda_graph``), ``gpu`` and ``constants``; at ``--level auto``
                   ``tvm_graph_ms`` (TVM's own build, compared and beaten) or
                   ``souffle_graph_ms`` (Souffle's, when TVM's was predicted faster and used)
                   or ``tvm_build_failed`` (TVM's own build raised: its error; Souffle's is kept)
database           the tuning database the compile read (``--database``), else null
rule_failures      souffle only: how many times a schedule rule raised on a group (candidates the
                   partitioner then split included) and the next rule was tried; a final
                   group's ``schedule_notes`` names the rules passed over for it and why
reductions         souffle v3/v4: the two-phase transform's record, ``split`` (reduction ->
                   form) and ``kept`` (each other GEMM-fed row reduction -> why it stayed whole)
counted            with ``--count-traffic`` (CUDA; the kernels run in the GPU emulator, small
                   models): ``bytes`` (Σ launches × counted distinct bytes), ``sector_bytes``
                   (what L1/L2 serve), ``analytic_held`` (how many analytic figures equal their
                   counts, ``report.counted``) and the ``differences``
=================  ==========================================================================
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields

SCHEMA_VERSION = 1


@dataclass
class KernelReport:
    name: str
    primfunc: str
    grid: list[int] | None
    block: list[int] | None
    registers: int | None
    shared_bytes: int | None
    spill_bytes: int | None
    launches: int
    bytes: int
    flops: int
    stages: list[str] | None = None      # stitched kernels: the stages it runs, in order
    grid_syncs: int | None = None        # stitched kernels: grid-wide barriers per launch
    cooperative: bool = False            # launched with cudaLaunchCooperativeKernel semantics
    max_coresident: int | None = None    # cooperative kernels: blocks that fit at once (ptxas + occupancy)
    schedule: str | None = None          # with a tuning database: "database", "default: <rule>", or per stage
    schedule_note: str | None = None     # why a database record was not used
    prefetched_bytes: int | None = None  # V4 stitched kernels: inputs prefetched into L2 ahead of their segment
    tensor_core: bool = False            # its arithmetic runs on tensor cores (MMA intrinsics in its TIR)
    written_bytes: int | None = None     # of ``bytes``, what it stores (sizes a contraction's operand traffic)
    elem_bytes: int | None = None        # element size of what it stores
    stage_plan: list[dict] | None = None  # stitched kernels: per stage tiles, threads, bytes, flops, tensor_core
    #                                       (and "phase" where stages run side by side, ``stitch.waves``)
    launches_outside_graph: int | None = None  # built with CUDA graphs: launches TVM's rewriting left outside them
    min_blocks: int | None = None        # stitched kernels with a register cap: __launch_bounds__ minimum blocks per SM
    on_chip: dict | None = None          # stitched kernels: what stays on chip (stages reading it there, bytes a block holds)
    counted: dict | None = None          # traffic counted in the emulator (``report.counted``), where it was run
    block_counts: dict | None = None     # what one block executes, from the lowered TIR (``cost.tir_counts``)
    predicted_us: float | None = None    # the latency model's time for one launch (an estimate)
    floor_us: float | None = None        # its largest static floor (``cost.floors``): predicted_us is never below
    floor_by: str | None = None          # which floor that is
    form: str | None = None              # its schedule form ("<rule>@<threads>"; a stitched kernel's stages joined by "+")
    measured_form: bool | None = None    # whether that form ever ran on a GPU (inside a measured total; cost/measured.py)
    measured_us: float | None = None     # measured on a device (``--measure``): one launch, median
    timed: str | None = None             # with --measure: "here" (this device), "elsewhere" (shipped times) or "predicted"


@dataclass
class Report:
    model: str
    target: str
    arch: str | None
    fusion: str
    launches: int
    distinct_kernels: int
    compile_seconds: float
    bytes: int
    flops: int
    nvcc: dict
    kernels: list[KernelReport] = field(default_factory=list)
    level: str | None = None
    groups: list[dict] = field(default_factory=list)
    subprograms: list[dict] = field(default_factory=list)
    group_edges: list[list[int]] = field(default_factory=list)
    fallback: str | None = None
    database: str | None = None          # the tuning database compile read (``--database``)
    rule_failures: int = 0               # souffle: schedule rules that raised (and were passed over)
    latency: dict | None = None          # CUDA: the latency model's prediction (an estimate)
    cuda_graph: dict | None = None       # built with TVM's CUDA-graph rewriting: replays, launches in/outside
    reductions: dict | None = None       # souffle v3+: two-phase {"split": {name: form}, "kept": {name: why}}
    counted: dict | None = None          # traffic counted in the emulator (``--count-traffic``): totals, differences
    measured: dict | None = None         # --level auto on a device: every candidate measured, the one kept and why
    schema_version: int = SCHEMA_VERSION

    def to_json(self) -> dict:
        return asdict(self)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=2)

    @classmethod
    def load(cls, path: str) -> "Report":
        with open(path) as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path} is not JSON ({err})") from None
        try:
            # Fields a newer version added are dropped (forward compatible); missing required
            # fields mean this is not a report at all.
            kernel_keys = {f.name for f in fields(KernelReport)}
            data = {k: v for k, v in data.items() if k in {f.name for f in fields(cls)}}
            data["kernels"] = [KernelReport(**{k: v for k, v in kr.items() if k in kernel_keys})
                               for kr in data.get("kernels", [])]
            return cls(**data)
        except (TypeError, AttributeError) as err:
            # a JSON file, but not one `compile --report` wrote (or from a newer schema)
            raise ValueError(f"{path} is not a souffle-tvm report: {err}") from None

    def table(self, max_rows: int = 40) -> str:
        """A readable summary: totals, then the kernels by launches × bytes."""
        arch = f" ({self.arch})" if self.arch else ""
        lines = [
            f"model {self.model}  target {self.target}{arch}  fusion {self.fusion}",
            f"launches/inference {self.launches}   distinct kernels {self.distinct_kernels}   "
            f"compile {self.compile_seconds:.2f} s",
            f"traffic {si(self.bytes)}B   work {si(self.flops)}FLOP   "
            f"resources: {'ptxas' if self.nvcc.get('available') else 'none (' + self.nvcc.get('note', '') + ')'}",
            "",
            f"{'kernel':<44} {'calls':>5} {'grid':>13} {'block':>11} {'regs':>4} {'smem':>7} {'spill':>5} "
            f"{'bytes':>8} {'flops':>8}",
        ]
        ranked = sorted(self.kernels, key=lambda k: -k.launches * max(k.bytes, 1))
        for k in ranked[:max_rows]:
            name = k.name if len(k.name) <= 43 else k.name[:40] + "..."
            name += "*" if k.measured_form is False else ""
            lines.append(
                f"{name:<44} {k.launches:>5} {dims(k.grid):>13} {dims(k.block):>11} {_opt(k.registers):>4} "
                f"{_opt(k.shared_bytes):>7} {_opt(k.spill_bytes):>5} {si(k.bytes):>8} {si(k.flops):>8}")
        if len(ranked) > max_rows:
            lines.append(f"... {len(ranked) - max_rows} more kernels (see the JSON report)")
        if self.database:
            lines += _schedule_lines(self)
        if self.latency:
            lat = self.latency
            lines.append(f"\npredicted GPU time on {lat['gpu']} (latency model, an estimate): {lat['ms']:.3f} ms "
                         f"launched one by one, {lat['graph_ms']:.3f} ms under a CUDA graph "
                         f"(kernels alone {lat['gpu_ms']:.3f} ms)")
            untimed = lat.get("untimed_share") or 0.0
            if untimed:
                lines.append(f"  {untimed:.0%} of the kernels' predicted time is in schedule forms no GPU has run "
                             f"(marked * above): an extrapolation of the model")
            if "tvm_graph_ms" in lat:
                rests = f", a choice resting {untimed:.0%} on untimed forms" if untimed else ""
                lines.append(f"TVM's own kernels, built to compare (--level auto): {lat['tvm_graph_ms']:.3f} ms "
                             f"under a CUDA graph; Souffle's build is kept{rests}")
            if "tvm_build_failed" in lat:
                lines.append(f"TVM's own kernels, built to compare (--level auto), failed to build "
                             f"({lat['tvm_build_failed']}); Souffle's build is kept")
            if self.cuda_graph:
                g = self.cuda_graph
                lines.append(f"built with TVM's CUDA-graph rewriting: {g['replays']} graph replays hold "
                             f"{g['captured_launches']} launches, {g['launches_outside']} launched outside; "
                             f"predicted {lat.get('rewrite_ms', float('nan')):.3f} ms")
        lines += _measured_lines(self)
        if self.fallback:
            lines.append(f"\nfallback to TVM's default path: {self.fallback}")
        if self.groups:
            lines.append(f"\nboundaries ({len(self.groups)} groups, level {self.level}):")
            lines += _reason_counts(self.groups)
        if self.subprograms:
            lines.append(f"subprograms ({len(self.subprograms)}, each one kernel when stitchable) end because:")
            lines += _reason_counts(self.subprograms)
        held = [k for k in self.kernels if k.on_chip and k.on_chip.get("stages")]
        if held:
            lines.append("kept on chip (shared memory):")
            for k in held[:max_rows]:
                oc = k.on_chip
                weights = f"; {len(oc['resident_inputs'])} weight copies read by later stages " \
                          f"({oc['resident_bytes']} B a block: {', '.join(sorted(set(oc['resident_inputs'])))})" \
                    if oc["resident_inputs"] else ""
                lines.append(f"  {k.name}: {oc['stages']} of {len(k.stages or [])} stages read or write on chip; "
                             f"channels {oc['channel_bytes']} B a block{weights}; "
                             f"{_size(oc['saved_bytes'])} kept off global memory")
            if len(held) > max_rows:
                lines.append(f"  ... {len(held) - max_rows} more stitched kernels")
        chained = [g for g in self.groups or [] if g.get("window_chain")]
        prologues = [g for g in self.groups or [] if g["reason"].startswith("prologue:")]
        if chained or prologues:
            lines.append(f"kept on chip in one kernel's shared memory: {len(chained)} window chains (a contraction's "
                         f"tile and its halo read by the window after it), {len(prologues)} prologues (a scale "
                         f"applied as the next GEMM loads its operand)")
        if self.reductions and (self.reductions["split"] or self.reductions["kept"]):
            red = self.reductions
            lines.append(f"two-phase reductions: {len(red['split'])} split, {len(red['kept'])} kept whole"
                         + (" because:" if red["kept"] else ""))
            lines += _reason_counts([{"reason": why} for why in red["kept"].values()])
        return "\n".join(lines)


def _measured_lines(report: "Report") -> list[str]:
    """What was measured on a device (``--measure``), or that the choice rests on predictions."""
    m = report.measured
    if not m:
        choice = (report.latency or {}).get("choice")
        if choice and choice.get("uncertain"):
            return [f"\nchoice uncertain (no device measured it): {choice['chosen']} kept by least worst-case regret; "
                    f"the fitted constants alone pick {choice['fitted_choice']}; it flips at "
                    + ("; ".join(choice["flips"]) or "a combination of constants")]
        return []
    lines = [f"\nmeasured on {m['where']} (reference {m['reference']}); kept {m['chosen']}: {m['why']}"]
    for c in m["candidates"]:
        pred = f"predicted {c['predicted_ms']:.4f} ms, " if c.get("predicted_ms") is not None else ""
        meas = (f"measured {c['ms']:.4f} ms (IQR {c['spread_ms']:.4f}, {c['runs']} runs)" if c.get("ms") is not None
                else "not measured")
        state = ", from the timing cache" if c.get("cached") else ""
        note = f"; note: {c['note']}" if c.get("note") else ""
        lines.append(f"  {c['name']:<18} {pred}{meas}{state}{note}")
    timed = [k.timed for k in report.kernels if k.timed]
    if timed:
        lines.append(f"  kernels of the kept build: {timed.count('here')} measured here, {timed.count('elsewhere')} "
                     f"measured elsewhere, {timed.count('predicted')} predicted only")
    return lines


def _schedule_lines(report: "Report") -> list[str]:
    """Which kernels' schedules came from the tuning database, which from the default rules."""
    tuned = [k for k in report.kernels if k.schedule == "database"]
    lines = [f"\nschedules: {len(tuned)} of {len(report.kernels)} kernels from the database {report.database}"]
    for k in report.kernels:
        note = f"  ({k.schedule_note})" if k.schedule_note else ""
        lines.append(f"  {k.name:<44} {k.schedule or '-'}{note}")
    return lines


def _reason_counts(items: list[dict]) -> list[str]:
    """How many boundaries each kind of reason drew (details after ':' or '(' folded)."""
    counts: dict[str, int] = {}
    for item in items:
        key = item["reason"].split(":")[0].split("(")[0].strip()
        counts[key] = counts.get(key, 0) + 1
    return [f"  {n:>4} x {r}" for r, n in sorted(counts.items(), key=lambda x: -x[1])]


def si(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.0f}"


def _opt(x) -> str:
    return "-" if x is None else str(x)


def dims(d) -> str:
    if d is None:
        return "-"
    while len(d) > 1 and d[-1] == 1:
        d = d[:-1]
    return "x".join(str(v) for v in d)


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e6:.1f} MB" if nbytes >= 100_000 else f"{nbytes / 1e3:.1f} KB"
