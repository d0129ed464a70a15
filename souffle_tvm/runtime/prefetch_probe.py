"""V4's prefetches checked in the emulator: the lines each prefetch loop touches, against what the
segment it was planted for reads.

``stitch.prefetch`` plants, at the end of segment k of a stitched kernel (the statements
between two grid syncs), loops that issue ``prefetch.global.L2`` for the 128-byte lines of the
input buffers that segment k + 1 *reads first*: ``prefetch.plan`` takes, per segment, the
kernel's inputs (buffers it never writes) that the segment reads and no earlier segment has
read. A prefetch is a hint without semantics, so the plain emulator drops it and no numerics
can tell a wrong one. This mode runs it instead: ``emulate.emulate_primfunc(...,
prefetches=PrefetchProbe(name))`` turns every prefetch into a record of the element address it
names, and records the lines of the prefetched buffers every segment reads, so that for each
prefetch loop (a *site*: one buffer, planted in segment k) it can be checked that

1. every prefetched address lies inside the buffer named (element 0 to numel - 1 of its flat view);
2. the buffer is one the kernel never writes;
3. it is read first by segment k + 1: no segment up to k reads it and k + 1 does (so the loop
   sits one segment ahead of its first reader, before the grid sync between them);
4. the lines prefetched (the union over every thread of every block) cover every line of the
   buffer that segment k + 1 reads, on the inputs run.

Lines are counted from the buffer's first element (``element * bytes // 128``), as the prefetch
loop counts them; that they are also the hardware's lines assumes 128-byte aligned buffers.
Lines prefetched but not read by segment k + 1 (a gather's unread rows) are reported, not
flagged. What is read is what runs: a branch not taken or a gather index not drawn reads
nothing here.

``PrefetchEmulation(mod, target).run(inputs, params)`` runs a whole model (or one kernel) and
returns its outputs and a ``PrefetchReport``; docs/emulator.md has the details.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import tvm
import tvm_ffi
from tvm import tirx

from ..cost.tir_stats import dtype_bytes
from ..errors import EmulationError
from ..stitch.kernel_ir import is_prefetch, op_name, replace_stages, stage_loops
from .instrumented import I64, InstrumentedModule, RunSession, as64, guarded_loads, i64, numel, seq

REPORT = "souffle_tvm.prefetch.report"
LINE_BYTES = 128
_MARK = "__souffle_prefetch"          # a prefetch, until the emulated phase records it
_PTX_PREFETCH = "tirx.ptx.prefetch"
_SITE_WORDS = 3                       # per site: addresses issued, outside the buffer, first outside + 1


def _lines(numel: int, dtype: str) -> int:
    return max(math.ceil(numel * dtype_bytes(dtype) / LINE_BYTES), 1)


@dataclass
class _Site:
    param: int            # position of the prefetched buffer among the kernel's parameters
    name: str
    dtype: str
    numel: int
    written: bool
    phase: int | None = None      # the grid-sync phase (segment) whose end issues it
    offset: int = 0               # of its line bitmap in the record


class PrefetchProbe:
    """The hooks ``emulate`` calls for one kernel: its prefetch loops kept as records, the reads
    of the buffers they name recorded per phase. ``sites`` and the record's layout are read back
    by ``_Session`` from the array the kernel hands over at its end (``REPORT``)."""

    def __init__(self, name: str):
        self.name = name
        self.sites: list[_Site] = []
        self.tracked: dict = {}           # parameter position -> (name, dtype, numel)
        self.params: list = []            # the kernel's parameters in launch form
        self.views: dict = {}             # buffers declared on a prefetched parameter's data -> its position
        self.reads: dict = {}             # (phase, parameter position) -> offset of its line bitmap
        self.phases = 0
        self.size = 0                     # words in the record
        # a stand-in for the record, whose size is known once every phase is emulated (wrap)
        self.record = tirx.decl_buffer([i64(1)], I64, f"prefetch_record_{name}", scope="global")

    # -- before lowering ---------------------------------------------------------------------------
    def mark(self, func: tirx.PrimFunc) -> tirx.PrimFunc:
        """``func`` (a stitched kernel, before launch form) with each prefetch of its prefetch loops
        replaced by a marker call naming its site and the element it prefetches (the flat index
        into the buffer's flat view)."""
        params = list(func.params)
        stored: list = []
        tvm_ffi.structural_walk(func.body, (tirx.BufferStore, lambda s: stored.append(s.buffer)))

        views = {}                       # the prefetch loops' flat views -> the buffer they alias
        for stmt in stage_loops(func):
            if is_prefetch(stmt):
                tvm_ffi.structural_walk(stmt, (tirx.DeclBuffer, lambda d: views.__setitem__(d.buffer, _aliased(d))))

        def site_of(view) -> int:
            base = next((b for v, b in views.items() if v.same_as(view)), view)
            for i, p in enumerate(params):
                if p.same_as(base):
                    return i
            raise EmulationError(f"{self.name}: a prefetch of {view.name}, not a view of a parameter of the kernel")

        def marker(ev):
            call = ev.value
            if op_name(call) != _PTX_PREFETCH:
                return ev
            addr = call.args[0]
            if op_name(addr) != "tirx.address_of" or not isinstance(addr.args[0], tvm.ir.TensorLoad) or \
                    len(addr.args[0].indices) != 1:
                raise EmulationError(f"{self.name}: a prefetch through {addr}, not the address of a flat element")
            load = addr.args[0]
            pos = site_of(load.source)
            p = params[pos]
            self.sites.append(_Site(pos, str(p.name), str(p.ty.dtype), numel(p), any(p.same_as(b) for b in stored)))
            self.tracked[pos] = (str(p.name), str(p.ty.dtype), numel(p))
            site = len(self.sites) - 1
            return tirx.Evaluate(tirx.call_extern("int32", _MARK, i64(site), as64(load.indices[0])))

        seq = [tvm_ffi.structural_map(s, (tirx.Evaluate, marker)) if is_prefetch(s) else s for s in stage_loops(func)]
        return replace_stages(func, seq) if self.sites else func

    def lowered(self, low: tirx.PrimFunc) -> None:
        """The kernel in launch form: the prefetched buffers and the views declared on them (the
        loads to record)."""
        self.params = list(low.params)
        self.views = {}
        tracked = {pos: self.params[pos] for pos in self.tracked}

        def view(d):
            base = _aliased(d)
            pos = next((q for q, p in tracked.items() if base is not None and p.same_as(base)), None)
            if pos is not None:
                self.views[d.buffer] = pos
        tvm_ffi.structural_walk(low.body, (tirx.DeclBuffer, view))

    # -- while emulating ---------------------------------------------------------------------------
    def phase(self, emu: tirx.Stmt) -> tirx.Stmt:
        """One grid-sync phase (one block's emulated statements): its prefetches recorded, and
        before every statement the lines of the prefetched buffers it reads."""
        k = self.phases
        self.phases += 1
        if not self.tracked:
            return emu
        data = {**{self.params[pos]: pos for pos in self.tracked}, **self.views}

        def prefetch(ev):
            call = ev.value
            if op_name(call) != "tirx.call_extern" or str(call.args[0].value) != _MARK:
                return None
            site = self.sites[int(call.args[1].value)]
            site.phase = k
            return self._issue(int(call.args[1].value), site, call.args[2])

        def before(node, exprs, then):
            recs = [r for e in exprs for r in self._reads(e, data, k)]
            return seq(recs + [then]) if recs else then

        def store(s):
            recs = [r for e in [s.value] + list(s.indices) for r in self._reads(e, data, k)]
            return seq(recs + [s]) if recs else s

        def evaluate(ev):
            out = prefetch(ev)
            return out if out is not None else before(ev, [ev.value], ev)

        return tvm_ffi.structural_map(emu, [
            (tirx.BufferStore, store),
            (tirx.IfThenElse, lambda x: before(x, [x.condition], x)),
            (tirx.For, lambda x: before(x, [x.min, x.extent], x)),
            (tirx.Bind, lambda x: before(x, [x.value], x)),
            (tirx.Evaluate, evaluate),
        ])

    def _word(self, offset) -> tirx.PrimExpr:
        return tirx.BufferLoad(self.record, [offset])

    def _set(self, offset, value) -> tirx.Stmt:
        return tirx.BufferStore(self.record, value, [offset])

    def _issue(self, n: int, site: _Site, index) -> tirx.Stmt:
        """A prefetch of element ``index`` of ``site``'s buffer: counted, its line marked if inside
        the buffer, else counted outside (the first such address kept)."""
        base = i64(n * _SITE_WORDS)
        a = tirx.Var("pf_addr", I64)
        per_line = max(LINE_BYTES // dtype_bytes(site.dtype), 1)
        inside = tirx.And(a >= i64(0), a < i64(site.numel))
        line = _slot(0, n) + tirx.floordiv(a, i64(per_line))
        outside = seq([tirx.IfThenElse(self._word(base + i64(1)) == i64(0), self._set(base + i64(2), a + i64(1)), None),
                        self._set(base + i64(1), self._word(base + i64(1)) + i64(1))])
        return seq([tirx.Bind(a, as64(index)), self._set(base, self._word(base) + i64(1)),
                     tirx.IfThenElse(inside, self._set(line, i64(1)), outside)])

    def _reads(self, expr, data: dict, k: int) -> list:
        """Records for the loads of prefetched buffers in ``expr``, each under the condition it is
        evaluated on (the branches of a Select or if_then_else)."""
        def position(load):
            return next((p for b, p in data.items() if load.source.same_as(b)), None)

        found = [(load, position(load), guard)
                 for load, guard in guarded_loads(expr, lambda load: position(load) is not None)]
        out = []
        for load, pos, guard in found:
            _, dtype, elems = self.tracked[pos]
            if (k, pos) not in self.reads:
                self.reads[(k, pos)] = -1          # placed by wrap
            f = tirx.Var("rd", I64)
            per_line = max(LINE_BYTES // dtype_bytes(dtype), 1)
            rec = seq([tirx.Bind(f, _flat(load.source, list(load.indices))),
                        tirx.IfThenElse(tirx.And(f >= i64(0), f < i64(elems)),
                                        self._set(_slot(1, k, pos) + tirx.floordiv(f, i64(per_line)), i64(1)),
                                        None)])
            out.append(tirx.IfThenElse(guard, rec, None) if guard is not None else rec)
        return out

    def wrap(self, body: list) -> list:
        """The kernel's statements with the record around them: allocated and zeroed before,
        handed to Python (``REPORT``) after."""
        if not self.sites:
            return body
        size = len(self.sites) * _SITE_WORDS
        for site in self.sites:
            site.offset = size
            size += _lines(site.numel, site.dtype)
        slots = {}
        for key in sorted(self.reads):
            _, dtype, elems = self.tracked[key[1]]
            slots[key] = size
            size += _lines(elems, dtype)
        self.reads = slots
        self.size = size
        record = tirx.decl_buffer([i64(size)], I64, self.record.name, scope="global")
        body = [_place(s, self, record) for s in body]
        i = tirx.Var("z", I64)
        pre = [tirx.AllocBuffer(record), tirx.For(i, i64(0), i64(size), tirx.ForKind.SERIAL,
                                                  tirx.BufferStore(record, i64(0), [i]))]
        return pre + body + [tirx.Evaluate(tirx.call_packed(REPORT, self.name, record))]


_SLOT = "__souffle_prefetch_slot"


def _slot(*key: int) -> tirx.PrimExpr:
    """Where a line bitmap starts in the record, known only once every phase is emulated (``wrap``
    places it): (0, site) a site's lines, (1, phase, parameter) the lines a phase reads."""
    return tirx.call_extern(I64, _SLOT, *[i64(k) for k in key])


def _place(stmt, probe: PrefetchProbe, record) -> tirx.Stmt:
    """``stmt`` with the record's placeholders resolved: the one-word stand-in buffer becomes the
    record, the bitmaps' slots their offsets."""
    def slot(call):
        if op_name(call) != "tirx.call_extern" or str(call.args[0].value) != _SLOT:
            return call
        key = tuple(int(a.value) for a in call.args[1:])
        return i64(probe.sites[key[1]].offset if key[0] == 0 else probe.reads[key[1:]])

    def load(x):
        return tirx.BufferLoad(record, list(x.indices)) if x.source.same_as(probe.record) else x

    def store(s):
        return tirx.BufferStore(record, s.value, list(s.indices)) if s.buffer.same_as(probe.record) else s

    stmt = tvm_ffi.structural_map(stmt, (tvm.ir.Call, slot))
    return tvm_ffi.structural_map(stmt, [(tvm.ir.TensorLoad, load), (tirx.BufferStore, store)])


def _aliased(decl):
    """The buffer whose memory a ``DeclBuffer`` declares a view of (None: not a view)."""
    data = decl.data
    return data.args[0] if op_name(data) == "tirx.buffer_data" else None


def _flat(buf, indices: list) -> tirx.PrimExpr:
    """The element ``indices`` name in ``buf``'s memory, counted from its data pointer."""
    shape = [as64(e) for e in buf.ty.shape]
    strides = [as64(e) for e in buf.ty.strides]
    if len(indices) != len(shape):
        raise EmulationError(f"an access with {len(indices)} indices to {buf.name} of {len(shape)} dimensions")
    f = i64(0)
    if strides:
        for i, s in zip(indices, strides):
            f = f + as64(i) * s
    else:
        for i, n in zip(indices, shape):
            f = f * n + as64(i)
    off = buf.ty.elem_offset
    return f + as64(off) if off is not None and not (isinstance(off, tirx.IntImm) and int(off) == 0) else f


# -- the check ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SiteCheck:
    """One prefetch loop in one kernel call: ``segment`` issues it (None: it never ran), for the
    lines of ``buffer`` that segment + 1 reads first. Line counts are of 128-byte lines."""

    kernel: str
    buffer: str
    segment: int | None
    issued: int                 # addresses prefetched, all threads of all blocks
    outside: int                # of which outside the buffer
    first_outside: int | None   # the first such element index
    lines: int                  # the buffer's lines
    prefetched: int             # distinct lines inside the buffer prefetched
    read_next: int              # distinct lines segment + 1 reads
    missing: list[int]          # lines segment + 1 reads that were not prefetched
    first_read: int | None      # the first segment that reads the buffer
    unread: int                 # lines prefetched that segment + 1 does not read (not a fault)
    written: bool               # the kernel writes the buffer
    last: bool                  # no segment follows

    @property
    def problems(self) -> list[str]:
        out = []
        where = f"{self.kernel}: the prefetch of {self.buffer} (segment {self.segment})"
        if self.segment is None:
            return [f"{self.kernel}: the prefetch of {self.buffer} never ran"]
        if self.outside:
            out.append(f"{where} issued {self.outside} address(es) outside the buffer, the first at element "
                       f"{self.first_outside}")
        if self.written:
            out.append(f"{where}: the kernel writes {self.buffer}")
        if self.last:
            out.append(f"{where}: no segment follows it")
        if self.first_read is None:
            out.append(f"{where}: no segment reads {self.buffer}")
        elif self.first_read != self.segment + 1:
            out.append(f"{where}: {self.buffer} is first read by segment {self.first_read}, not {self.segment + 1}")
        if self.missing:
            out.append(f"{where} misses {len(self.missing)} of the {self.read_next} line(s) segment "
                       f"{self.segment + 1} reads, the first line {self.missing[0]}")
        return out


@dataclass
class PrefetchReport:
    sites: list[SiteCheck] = field(default_factory=list)    # per kernel call, per prefetch loop
    calls: int = 0                                           # kernel calls with a prefetch loop

    @property
    def problems(self) -> list[str]:
        # a fault repeats in every call of its kernel: each is said once
        return list(dict.fromkeys(p for s in self.sites for p in s.problems))

    @property
    def ok(self) -> bool:
        return not self.problems

    def __str__(self) -> str:
        if self.ok:
            lines = sum(s.prefetched for s in self.sites)
            return (f"{len(self.sites)} prefetch loop(s) in {self.calls} kernel call(s), {lines} line(s): inside "
                    f"their buffers, one segment ahead of the first reader, covering what it reads")
        return f"{len(self.problems)} prefetch problem(s):\n  " + "\n  ".join(self.problems)


class _Session(RunSession):
    current: "_Session | None" = None
    kind = "prefetch-checked"

    def __init__(self, probes: dict):
        self.probes = probes
        self.report = PrefetchReport()

    def record(self, kernel: str, rec: np.ndarray) -> None:
        probe = self.probes[kernel]
        self.report.calls += 1

        def bitmap(offset: int, lines: int) -> np.ndarray:
            return np.flatnonzero(rec[offset:offset + lines])

        for n, site in enumerate(probe.sites):
            _, dtype, elems = probe.tracked[site.param]
            lines = _lines(elems, dtype)
            issued, outside, first = (int(x) for x in rec[n * _SITE_WORDS:(n + 1) * _SITE_WORDS])
            got = bitmap(site.offset, lines)
            read = {k: bitmap(off, lines) for (k, pos), off in probe.reads.items() if pos == site.param}
            first_read = min((k for k, r in read.items() if len(r)), default=None)
            nxt = read.get(site.phase + 1, np.zeros(0, "int64")) if site.phase is not None else np.zeros(0, "int64")
            self.report.sites.append(SiteCheck(
                kernel, site.name, site.phase, issued, outside, first - 1 if outside else None, lines, len(got),
                len(nxt), [int(x) for x in np.setdiff1d(nxt, got)], first_read, len(np.setdiff1d(got, nxt)),
                site.written, site.phase is not None and site.phase + 1 >= probe.phases))


@tvm_ffi.register_global_func(REPORT, override=True)
def _report(kernel: str, record) -> int:
    if _Session.current is not None:
        _Session.current.record(kernel, record.numpy())
    return 0


class PrefetchEmulation(InstrumentedModule):
    """``mod``'s PrimFuncs emulated with their prefetch loops recorded (``PrefetchProbe``),
    compiled for llvm once. A module with a Relax ``main`` runs through the VM; a module of one
    PrimFunc is called with its arguments."""

    def __init__(self, mod: tvm.IRModule, target: tvm.target.Target):
        super().__init__(mod, target, PrefetchProbe, "prefetches")

    @property
    def sites(self) -> int:
        """Prefetch loops found in the module's kernels."""
        return sum(len(p.sites) for p in self.probes.values())

    def run(self, inputs: list, params: list | None = None) -> tuple[list, PrefetchReport]:
        """Outputs of ``main`` (or every argument of a lone PrimFunc, after the call) and the check."""
        with _Session(self.probes) as session:
            outs = self.call(inputs, params)
        return outs, session.report
