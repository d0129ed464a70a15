"""Traffic counted by execution: what the emulated kernels really load and store.

The report's ``bytes`` per kernel is analytic (``cost.tir_stats``: each global buffer's access
box from the unscheduled TIR). This counts instead what the scheduled kernels execute, in the GPU
emulator (``emulate``) instrumented by ``traffic_probe``: per launch region (one ``__global__``)
and global buffer, the distinct bytes read and written (what must cross the chip boundary at
least once), the warp requests and the 32-byte sectors they touch (what L1/L2 serve; sectors per
request show coalescing), and shared-memory accesses. docs/emulator.md says what it cannot see.

    counted = traffic.count(mod, target, inputs, params)      # {(PrimFunc, region): LaunchTraffic}
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import tvm
import tvm_ffi

from .instrumented import InstrumentedModule, RunSession
from .traffic_probe import DISTINCT, FIELDS, REPORT, SHARED_FIELDS, TrafficProbe


@dataclass
class BufferTraffic:
    """One global buffer in one launch: elements read, written and touched at least once (distinct),
    warp requests and the sectors they touched, and accesses per thread."""

    name: str
    elem_bytes: int
    index: int = 0                    # the buffer's identity in its kernel (names may repeat)
    scratch: bool = False             # global memory the kernel allocates itself (not a parameter)
    distinct_read: int = 0
    distinct_written: int = 0
    distinct: int = 0
    read_requests: int = 0
    read_sectors: int = 0
    write_requests: int = 0
    write_sectors: int = 0
    reads: int = 0
    writes: int = 0
    outside: int = 0                  # accesses outside the buffer (the emulated run skips them)

    @property
    def distinct_bytes(self) -> int:
        return self.distinct * self.elem_bytes


@dataclass
class LaunchTraffic:
    """One launch region of a PrimFunc (``region``: its position among the PrimFunc's kernels), as
    counted on its first call; ``calls``: how often it ran, ``same_every_call``: whether every
    call counted the same; ``sectors_exact``: False where some of its accesses ran in a loop of
    one thread (``traffic_probe``: their sectors are an upper bound where lanes share sectors).
    ``stages``: a stitched kernel's stage loops, each counted as if alone (a buffer two stages
    touch is distinct in each); ``buffers`` counts the launch as a whole; ``function_bytes``
    the PrimFunc's whole call (all its launches), parameters only."""

    function: str
    region: int
    buffers: list[BufferTraffic]
    shared: dict = field(default_factory=dict)          # SHARED_FIELDS -> count
    calls: int = 1
    same_every_call: bool = True
    sectors_exact: bool = True
    stages: list["LaunchTraffic"] = field(default_factory=list)
    function_bytes: int = 0            # distinct bytes of its parameters the whole PrimFunc call touched
    group_bytes: list[int] = field(default_factory=list)   # distinct bytes per group of stage loops asked for

    @property
    def distinct_bytes(self) -> int:
        """Bytes that must cross the chip boundary at least once: each element once, read or written."""
        return sum(b.distinct_bytes for b in self.buffers)

    @property
    def written_bytes(self) -> int:
        return sum(b.distinct_written * b.elem_bytes for b in self.buffers)

    @property
    def requests(self) -> int:
        return sum(b.read_requests + b.write_requests for b in self.buffers)

    @property
    def sectors(self) -> int:
        return sum(b.read_sectors + b.write_sectors for b in self.buffers)

    @property
    def sectors_per_request(self) -> float | None:
        return self.sectors / self.requests if self.requests else None

    def as_dict(self) -> dict:
        spr = self.sectors_per_request
        return {"distinct_bytes": self.distinct_bytes, "written_bytes": self.written_bytes,
                "requests": self.requests, "sectors": self.sectors,
                "sectors_per_request": None if spr is None else round(spr, 3),
                "sectors_exact": self.sectors_exact,
                "shared_accesses": int(self.shared.get("reads", 0) + self.shared.get("writes", 0)),
                "outside": sum(b.outside for b in self.buffers) + int(self.shared.get("outside", 0)),
                "calls": self.calls}


class _Session(RunSession):
    current: "_Session | None" = None
    kind = "traffic-counted"

    def __init__(self, probes: dict):
        self.probes = probes
        self.first: dict[str, np.ndarray] = {}
        self.calls: dict[str, int] = {}
        self.same: dict[str, bool] = {}

    def record(self, kernel: str, both: np.ndarray) -> None:
        if kernel not in self.first:
            self.first[kernel] = both.copy()
        else:
            self.same[kernel] = self.same.get(kernel, True) and bool(np.array_equal(self.first[kernel], both))
        self.calls[kernel] = self.calls.get(kernel, 0) + 1

    def launches(self) -> dict[tuple[str, int], LaunchTraffic]:
        out = {}
        for kernel, both in self.first.items():
            probe = self.probes[kernel]
            rows = len(probe.names) + 1
            split, call, group = probe.offsets["region"], probe.offsets["call"], probe.offsets["group"]
            seg = both[:split].reshape(-1, rows, len(FIELDS))
            reg = both[split:call].reshape(-1, rows, len(DISTINCT))
            whole_call = both[call:group].reshape(rows, len(DISTINCT))
            groups = both[group:].reshape(-1, rows, len(DISTINCT))
            calls, same = self.calls[kernel], self.same.get(kernel, True)

            def launch(counts, region, exact, distinct=None) -> LaunchTraffic:
                buffers = []
                for i, (name, elem, scratch) in enumerate(zip(probe.names, probe.elem_bytes, probe.scratch)):
                    values = dict(zip(FIELDS, (int(v) for v in counts[i])))
                    if distinct is not None:
                        values.update(zip(DISTINCT, (int(v) for v in distinct[i])))
                    if values["reads"] or values["writes"]:
                        buffers.append(BufferTraffic(name, elem, i, scratch, **values))
                shared = {f: int(counts[len(probe.names)][FIELDS.index(f)]) for f in SHARED_FIELDS}
                return LaunchTraffic(kernel, region, buffers, shared, calls, same, exact)

            for region in range(probe.regions):
                idx = [i for i, (r, _) in enumerate(probe.segments) if r == region]
                whole = launch(seg[idx].sum(axis=0), region, not set(idx) & probe.looped_segments, reg[region])
                whole.stages = [launch(seg[i], region, i not in probe.looped_segments)
                                for i in idx if probe.segments[i][1] >= 0]
                out[(kernel, region)] = whole
            function_bytes = sum(int(whole_call[i][2]) * elem for i, elem in enumerate(probe.elem_bytes)
                                 if not probe.scratch[i])
            for region in range(probe.regions):
                out[(kernel, region)].function_bytes = function_bytes
                out[(kernel, region)].group_bytes = [
                    sum(int(g[i][2]) * elem for i, elem in enumerate(probe.elem_bytes)) for g in groups
                ] if probe.stage_groups else []
        return out


@tvm_ffi.register_global_func(REPORT, override=True)
def _report(kernel: str, counts) -> int:
    if _Session.current is not None:
        _Session.current.record(kernel, counts.numpy())
    return 0


class Counting(InstrumentedModule):
    """``mod``'s PrimFuncs emulated with the traffic counter built in, compiled for llvm once.
    ``stage_groups``: PrimFunc name -> per stitched stage loop the group it is also counted in
    (``LaunchTraffic.group_bytes``)."""

    def __init__(self, mod: tvm.IRModule, target: tvm.target.Target, stage_groups: dict | None = None):
        groups = stage_groups or {}
        super().__init__(mod, target, lambda name: TrafficProbe(name, groups.get(name)), "probe")

    def run(self, inputs: list, params: list | None = None) -> tuple[list, dict[tuple[str, int], LaunchTraffic]]:
        """Outputs of ``main`` (or every argument of a lone PrimFunc) and the counts per launch."""
        with _Session(self.probes) as session:
            outs = self.call(inputs, params)
        return outs, session.launches()


def count(mod: tvm.IRModule, target: tvm.target.Target, inputs: list, params: list | None = None,
          stage_groups: dict | None = None) -> dict[tuple[str, int], LaunchTraffic]:
    """The traffic of every launch ``mod``'s kernels make on ``inputs`` (``params``: the weights
    ``main`` takes after them), keyed by (PrimFunc, launch region); ``stage_groups`` as
    ``Counting``'s."""
    return Counting(mod, target, stage_groups).run(inputs, params)[1]
