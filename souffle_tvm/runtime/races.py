"""An independent race checker: what the emulated kernels actually access, checked for conflicts.

``stitch.check`` asks ``stitch.dependence``, the proof that placed the barriers, whether they
suffice: it catches a barrier removed after the fact, never a wrong proof. This checker knows
nothing of that proof. It runs the kernels through the emulator (``emulate``) instrumented by
``race_probe``: every access of a global buffer the kernel writes, and of shared memory, is
recorded per block and grid-sync phase and per thread and barrier interval, and flagged when
it conflicts with another block's (thread's) access of the same element in the same phase
(interval): a read of another's write, a write to what another read or wrote, a plain access
to what another updated atomically (atomic updates among themselves are fine).

The blocks of a phase and the threads of a lock-step statement run in the order asked
(``ascending``, ``descending`` or a seeded shuffle; ``Order``), chosen at run time, so one
compiled ``Emulation`` runs every order; the race verdict does not depend on it, the numerics
of a racy kernel may. docs/emulator.md lists what the checker sees and what it cannot.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import tvm
import tvm_ffi
from tvm import tirx

from .race_probe import KINDS, LEVELS, LOG_COLUMNS, ORDER, REPORT, Probe, decode
from .instrumented import InstrumentedModule, RunSession

ASCENDING, DESCENDING = "ascending", "descending"


@dataclass(frozen=True)
class Order:
    """How the blocks of each phase and the threads of each lock-step statement are ordered:
    ``"ascending"``, ``"descending"`` or an int seed (a shuffle, new for each table: each
    phase, each call)."""

    blocks: str | int = ASCENDING
    threads: str | int = ASCENDING

    @staticmethod
    def of(order) -> "Order":
        """An ``Order``; a string or seed orders blocks and threads alike ("shuffle:SEED" is SEED)."""
        if isinstance(order, Order):
            return order
        if isinstance(order, str) and order.isdigit():
            order = int(order)
        if isinstance(order, str) and order.startswith("shuffle"):
            order = int(order.partition(":")[2] or 0)
        if not (isinstance(order, int) or order in (ASCENDING, DESCENDING)):
            raise ValueError(f"order {order!r}: ascending, descending, shuffle:SEED or a seed")
        return Order(order, order)

    def __str__(self) -> str:
        def one(o):
            return o if isinstance(o, str) else f"shuffle:{o}"
        return one(self.blocks) if self.blocks == self.threads else f"blocks {one(self.blocks)}, threads {one(self.threads)}"


@dataclass(frozen=True)
class Race:
    """Two accesses of one element, at least one a (non-atomic) write, with no barrier between.

    ``level`` "blocks": ``first`` and ``second`` are blocks of one grid-sync ``phase``;
    "threads": they are threads of ``block`` in one barrier interval. ``first`` is whoever
    touched the element before ``second`` in the emulated order (None: several readers or
    atomic updaters). ``index`` is the element's row-major flat index in ``buffer``."""

    kernel: str
    level: str
    kind: str
    buffer: str
    index: int
    phase: int
    first: int | None
    second: int
    block: int

    def __str__(self) -> str:
        who = "blocks" if self.level == "blocks" else f"threads (block {self.block})"
        first = "several" if self.first is None else self.first
        return (f"{self.kernel}: {self.kind} on {self.buffer}[{self.index}] between {who} {first} and "
                f"{self.second}, phase {self.phase}")


@dataclass
class RaceReport:
    order: str
    kernels: list[str]
    races: list[Race] = field(default_factory=list)     # distinct (kernel, level, kind, buffer, index), capped
    count: int = 0                                       # racy accesses seen, all of them
    benign: int = 0          # writes over another's write of the same value in one phase / interval
    benign_kernels: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.count == 0

    def kinds(self) -> set[tuple[str, str, str]]:
        """(level, kind, buffer) of the races logged."""
        return {(r.level, r.kind, r.buffer) for r in self.races}

    def __str__(self) -> str:
        if self.ok:
            rewrites = (f" ({self.benign} same-value rewrite(s), in {', '.join(self.benign_kernels)})"
                        if self.benign else "")
            return f"no race in {len(self.kernels)} kernel(s), order {self.order}{rewrites}"
        groups: dict = {}
        for r in self.races:
            groups.setdefault((r.kernel, r.level, r.kind, r.buffer), []).append(r)
        lines = [f"{k[0]}: {k[2]} on {k[3]} between {k[1]}, {len(rs)} element(s) logged, e.g. {rs[0]}"
                 for k, rs in groups.items()]
        return f"{self.count} racy access(es), order {self.order}:\n  " + "\n  ".join(lines)


class _Session(RunSession):
    """One run: fills the order tables and gathers the kernels' logs (through the callbacks below)."""

    current: "_Session | None" = None
    kind = "race-checked"

    def __init__(self, order: Order, probes: dict, keep: int):
        self.order, self.probes, self.keep = order, probes, keep
        self.rngs = {kind: np.random.default_rng(seed) for kind, seed in
                     (("blocks", order.blocks), ("threads", order.threads)) if isinstance(seed, int)}
        self.report = RaceReport(str(order), sorted(probes))
        self.seen: set = set()

    def permutation(self, kind: str, n: int) -> np.ndarray:
        how = getattr(self.order, kind)
        if how == ASCENDING:
            return np.arange(n, dtype="int64")
        if how == DESCENDING:
            return np.arange(n - 1, -1, -1, dtype="int64")
        return self.rngs[kind].permutation(n).astype("int64")

    def record(self, kernel: str, counts: np.ndarray, log: np.ndarray) -> None:
        """A kernel call's counts (per level: blocks, threads; then same-value rewrites) and log rows."""
        counts, benign = counts[:len(LEVELS)], int(counts[len(LEVELS)])
        self.report.count += int(counts.sum())
        self.report.benign += benign
        if benign and kernel not in self.report.benign_kernels:
            self.report.benign_kernels.append(kernel)
        names = self.probes[kernel].names
        per_level = log.reshape(len(counts), -1, len(LOG_COLUMNS))
        for level, count in enumerate(counts):
            for row in per_level[level][:min(int(count), per_level.shape[1])]:
                r = decode(row)
                race = Race(kernel, LEVELS[r["level"]], KINDS[r["kind"]], names[r["buffer"]], r["index"],
                            r["phase"] - 1, None if r["other"] < 0 else r["other"], r["who"], r["block"])
                key = (kernel, race.level, race.kind, race.buffer, race.index)
                if key not in self.seen and len(self.report.races) < self.keep:
                    self.seen.add(key)
                    self.report.races.append(race)


@tvm_ffi.register_global_func(ORDER, override=True)
def _fill_order(kind: str, table) -> int:
    session = _Session.current
    if session is None:
        raise RuntimeError("a race-checked kernel ran outside Emulation.run")
    table.copyfrom(session.permutation(kind, int(table.shape[0])))
    return 0


@tvm_ffi.register_global_func(REPORT, override=True)
def _report(kernel: str, count, log) -> int:
    if _Session.current is not None:
        _Session.current.record(kernel, count.numpy(), log.numpy())
    return 0


class Emulation(InstrumentedModule):
    """``mod``'s PrimFuncs emulated with the race checker built in, compiled for llvm once; run
    it in any order. A module with a Relax ``main`` runs through the VM (``run``); a module of
    one PrimFunc is called directly with its arguments."""

    def __init__(self, mod: tvm.IRModule, target: tvm.target.Target, keep: int = 200):
        super().__init__(mod, target, Probe, "probe")
        self.keep = keep

    def run(self, inputs: list, params: list | None = None, order="ascending") -> tuple[list, RaceReport]:
        """Outputs of ``main`` (or every argument of a lone PrimFunc, after the call) and the races seen."""
        with _Session(Order.of(order), self.probes, self.keep) as session:
            outs = self.call(inputs, params)
        return outs, session.report


def arguments(func: tirx.PrimFunc, seed: int = 0) -> list[np.ndarray]:
    """Arguments for a lone kernel: floats drawn at random, integers zero (safe gather indices)."""
    rng = np.random.default_rng(seed)
    out = []
    for p in func.params:
        shape, dtype = [int(e) for e in p.ty.shape], str(p.ty.dtype)
        out.append(rng.standard_normal(shape).astype(dtype) if dtype.startswith("float") else np.zeros(shape, dtype))
    return out


def check(mod_or_func, target: tvm.target.Target, order="ascending", params: list | None = None,
          inputs: list | None = None) -> RaceReport:
    """The races the emulated kernels of ``mod_or_func`` run into, in ``order``.

    A module with a Relax ``main`` needs its ``inputs`` (and the weights, ``params``); a lone
    PrimFunc (or a module of one) runs on ``inputs`` if given, else on ``arguments(func)``."""
    mod = mod_or_func if isinstance(mod_or_func, tvm.IRModule) else tvm.IRModule({"kernel": mod_or_func})
    if inputs is None:
        funcs = list(mod.functions.values())
        if len(funcs) != 1 or not isinstance(funcs[0], tirx.PrimFunc):
            raise ValueError("a module with a Relax main needs its inputs")
        inputs = arguments(funcs[0])
    return Emulation(mod, target).run(inputs, params, order)[1]
