"""The traffic counter's instrumentation of an emulated kernel (``runtime.traffic`` builds and runs it).

``emulate.emulate_primfunc(..., probe=TrafficProbe(name))`` calls the hooks below while it rewrites
a kernel for the CPU, as it calls the race checker's (``race_probe``). Nothing here reads the
analytic footprints the report carries (``cost.tir_stats``): the counts come from the accesses the
emulated kernel executes, per launch region (one ``__global__``), per global buffer:

* **distinct** elements read, written, and touched either way (what must cross the chip boundary
  at least once: a byte read twice, or written then read back, counts once);
* **requests**: warp-level access instructions executed (a lane whose access is masked off by
  a guard does not take part; a warp with no lane taking part makes no request), reads and
  writes apart; and **sectors**: the distinct 32-byte sectors each request touches, summed
  (what L1/L2 serve: 4 for a coalesced fp32 warp load, 32 when each lane reads another row);
* shared memory: accesses per thread and requests per warp (no sectors; bank conflicts are not
  modelled).

How a warp's request is told apart. Under lock step each leaf statement runs for all threads of
a block, lane 0 first, so the lanes of one warp executing one access site follow each other: the
request is (statement instance, warp, site). A statement under thread-dependent control flow runs
per thread as a unit (``emulate``), loops included: there the k-th execution of a site by a lane
is that lane's part of the warp's k-th request (SIMT), so the request is (statement instance,
warp, site, k), k counted per thread. Each request gets a stamp; a request is new when its site's
slot holds another stamp, a sector new to the request when the site's sector word (one per
buffer and site) holds another. Within such a unit two lanes that touch one sector at the same k
are one sector only if no lane of the warp touched it at another k in between (the sector word
keeps the last stamp), so
sectors there are an upper bound where lanes share sectors; they are exact where they do not
(a thread per row, ``PartialRows``), and everywhere under lock step.
"""

from __future__ import annotations

import math

import tvm
import tvm_ffi
from tvm import tirx

from ..errors import EmulationError
from ..core.ir_names import EMULATED_VECTOR, STAGE_BLOCKS
from .instrumented import as64, guarded_loads, i64, numel, on_flat_block, seq

REPORT = "souffle_tvm.traffic.report"
# Counts per segment (a launch region's statements before its first stitched stage loop, then each
# stage loop with what follows it up to the next): a row per global buffer, then one for shared
# memory (its SHARED_FIELDS columns); per launch region and for the whole call, the distinct counts.
FIELDS = ("distinct_read", "distinct_written", "distinct", "read_requests", "read_sectors",
          "write_requests", "write_sectors", "reads", "writes", "outside")
SHARED_FIELDS = ("read_requests", "write_requests", "reads", "writes", "outside")
DISTINCT = FIELDS[:3]
SECTOR = 32
_WARP = 32
_I64 = "int64"
_FLAG = "int64"                  # a word of read (1) / written (2) bits
_SITES = 1 << 12                 # access sites per kernel, at most (stamp layout below)
_KS = 1 << 16                    # executions of one site by one thread in one statement, at most
_WARPS = 1 << 5                  # warps per block (1024 threads)
_READ, _WRITE = 0, 1


def _buffer(shape: list, dtype: str, name: str) -> tirx.Var:
    return tirx.decl_buffer([i64(n) for n in shape], dtype, name, scope="global")


def _flat(indices, shape: list[int]) -> tirx.PrimExpr:
    if len(indices) != len(shape):
        raise EmulationError(f"an access with {len(indices)} indices to a buffer of {len(shape)} dimensions")
    f = i64(0)
    for i, n in zip(indices, shape):
        f = f * i64(n) + as64(i)
    return f


def _elem_bytes(buf) -> int:
    dt = tvm.DataType(str(buf.ty.dtype))
    return max(dt.bits * dt.lanes // 8, 1)


class _Global:
    """One global buffer's words: per element, for the whole call, for each launch region and for
    each segment that touches it, whether it was read (bit 1) or written (bit 2) there (segments
    of one grid-sync phase run block by block, interleaved, so a last-toucher stamp would not
    do); per access site and sector the stamp of the site's last request that touched it (one
    word per site: with one word per buffer, two sites of one statement on one sector would
    overwrite each other's stamp between lanes and count the sector again for every lane)."""

    def __init__(self, index: int, buf):
        self.index, self.buf = index, buf
        self.shape = [int(e) for e in buf.ty.shape]
        self.elem = _elem_bytes(buf)
        self.n = max(numel(buf), 1)
        self.level_flags: dict[tuple, tirx.Var] = {}
        self.site_sectors: dict[int, tirx.Var] = {}

    def sectors(self, site: int) -> tirx.Var:
        """The sector stamps of access site ``site``."""
        if site not in self.site_sectors:
            self.site_sectors[site] = _buffer([max(math.ceil(self.n * self.elem / SECTOR), 1)], _I64,
                                              f"{self.buf.name}_sectors{site}")
        return self.site_sectors[site]

    def flags(self, level: str, at: int = 0) -> tirx.Var:
        """The read/written bits of ``level`` ("call", "region", "segment") number ``at``."""
        if (level, at) not in self.level_flags:
            self.level_flags[(level, at)] = _buffer([self.n], _FLAG, f"{self.buf.name}_{level}{at}")
        return self.level_flags[(level, at)]

    def arrays(self) -> list:
        return list(self.level_flags.values()) + list(self.site_sectors.values())


class _Looped:
    """The words of one statement that loops per thread (see the module's doc): ``site`` numbers
    its access sites as they are instrumented."""

    def __init__(self, ident: int, threads: int, width: int):
        self.width, self.site = width, -1
        warps = (threads + _WARP - 1) // _WARP
        self.k_inst = _buffer([threads * width], _I64, f"traffic_k_inst{ident}")
        self.k = _buffer([threads * width], _I64, f"traffic_k{ident}")
        self.r_inst = _buffer([warps * width], _I64, f"traffic_r_inst{ident}")
        self.r = _buffer([warps * width], _I64, f"traffic_r{ident}")
        self._warp_slot = None

    def arrays(self) -> list:
        return [self.k_inst, self.k, self.r_inst, self.r]

    def next_execution(self, t, warp, inst, kv) -> list:
        """Statements binding ``kv`` to how often thread ``t`` ran the next site before (then counted)."""
        self.site += 1
        if self.site >= self.width:
            raise EmulationError("more access sites in a looping statement than were counted")
        slot, wslot = tirx.Var("ks", _I64), tirx.Var("ws", _I64)
        self._warp_slot = wslot

        def fresh(inst_buf, buf, at):
            return tirx.IfThenElse(tirx.BufferLoad(inst_buf, [at]) != inst,
                                   seq([tirx.BufferStore(inst_buf, inst, [at]), tirx.BufferStore(buf, i64(0), [at])]), None)
        return [tirx.Bind(slot, t * i64(self.width) + i64(self.site)),
                tirx.Bind(wslot, warp * i64(self.width) + i64(self.site)),
                fresh(self.k_inst, self.k, slot), fresh(self.r_inst, self.r, wslot),
                tirx.Bind(kv, tirx.BufferLoad(self.k, [slot])),
                tirx.BufferStore(self.k, kv + i64(1), [slot])]

    def new_request(self, warp, kv) -> tuple:
        """(whether the lane's k-th execution of the site is a request no lower lane made, what to
        store when it is): lanes run in order, so the warp's requests so far are its lanes' most."""
        return (kv >= tirx.BufferLoad(self.r, [self._warp_slot]),
                [tirx.BufferStore(self.r, kv + i64(1), [self._warp_slot])])


class TrafficProbe:
    """The hooks ``emulate`` calls, for one kernel; ``names`` are its global buffers by row."""

    def __init__(self, name: str, stage_groups: list[int] | None = None):
        self.name = name
        # per stitched stage loop (in order), the group it is counted with as well: the launch
        # regions of one stage function form one group (``report.counted``)
        self.stage_groups = list(stage_groups or [])
        self.stage_no = -1
        self.group = -1
        self.names: list[str] = []
        self.elem_bytes: list[int] = []
        self.scratch: list[bool] = []             # per row: allocated by the kernel, not a parameter
        self.globals: dict = {}                   # real global buffer -> _Global
        self.shared_copies: set = set()           # the emulator's per-block copies of shared buffers
        self.regions = 0
        self.region = -1                          # the launch region being emulated
        self.segments: list[tuple[int, int]] = []  # (region, stage: -1 before the first stage loop)
        self.segment = -1
        self.sites = 0
        self.inst = _buffer([1], _I64, "traffic_inst")             # lock-step statement instances
        self.requests = _buffer([_SITES], _I64, "traffic_requests")  # per site: its last request's stamp
        # one array: [segments, buffers + 1, FIELDS], then [regions, buffers + 1, DISTINCT], then
        # [buffers + 1, DISTINCT] for the whole call (made in prepare; ``offsets``: where each starts)
        self.counts = None
        self.offsets: dict[str, int] = {}
        self.looped: list = []                    # per-thread execution counters, if a unit loops
        self.looped_segments: set[int] = set()    # segments whose sectors are an upper bound (module doc)
        self.block = None

    # -- before emulation ---------------------------------------------------------------------------
    def prepare(self, low: tirx.PrimFunc, target) -> tirx.PrimFunc:
        """Track the kernel's global buffers: its parameters and the scratch it allocates."""
        top = list(low.body.seq) if isinstance(low.body, tirx.SeqStmt) else [low.body]
        scratch = [s.buffer for s in top if isinstance(s, tirx.AllocBuffer)
                   and str(s.buffer.ty.storage_scope) in ("global", "")]
        for buf in [p for p in low.params if hasattr(p.ty, "shape")] + scratch:
            if buf not in self.globals:
                self.globals[buf] = _Global(len(self.names), buf)
                self.names.append(str(buf.name))
                self.elem_bytes.append(_elem_bytes(buf))
                self.scratch.append(any(buf.same_as(b) for b in scratch))
        regions = [s for s in top if isinstance(s, tirx.AttrStmt) and s.attr_key == "thread_extent"]
        self.regions = len(regions)
        for r, region in enumerate(regions):
            body = region
            while isinstance(body, tirx.AttrStmt) and body.attr_key in ("thread_extent", "virtual_thread"):
                body = body.body
            stages = sum(1 for st in (body.seq if isinstance(body, tirx.SeqStmt) else [body])
                         if isinstance(st, tirx.For) and STAGE_BLOCKS in st.annotations)
            self.segments += [(r, k) for k in range(-1, stages)]
        rows = len(self.names) + 1
        sizes = {"segment": max(len(self.segments), 1) * rows * len(FIELDS),
                 "region": max(self.regions, 1) * rows * len(DISTINCT), "call": rows * len(DISTINCT),
                 "group": (max(self.stage_groups) + 1 if self.stage_groups else 1) * rows * len(DISTINCT)}
        at = 0
        for level, size in sizes.items():
            self.offsets[level], at = at, at + size
        self.counts = _buffer([at], _I64, "traffic_counts")
        return low

    # -- hooks while emulating ------------------------------------------------------------------------
    def launch(self) -> None:
        """The next launch region (one ``__global__``) starts."""
        self.region += 1
        self._next_segment()

    def stage(self) -> None:
        """The next stitched stage loop starts."""
        self._next_segment()
        self.stage_no += 1
        self.group = self.stage_groups[self.stage_no] if self.stage_no < len(self.stage_groups) else -1

    def _next_segment(self) -> None:
        self.segment += 1
        if self.segment >= len(self.segments) or self.segments[self.segment][0] != self.region:
            raise EmulationError(f"{self.name}: launch regions or stage loops other than prepare found")

    def shared(self, buf) -> None:
        """A block's copy of a shared buffer: its accesses are counted as shared memory's."""
        self.shared_copies.add(buf)

    def phase(self, blocks: dict, run) -> tirx.Stmt:
        """One grid-sync phase: ``run()`` emulates one block; every block runs, in ascending order
        (what is counted does not depend on the order)."""
        self.block = tirx.Var(f"block_r{self.region}", _I64)
        body, n = on_flat_block(self.block, blocks, run())
        return tirx.For(self.block, i64(0), i64(n), tirx.ForKind.SERIAL, body)

    def threads(self, t: tirx.Var, n: int, body: tirx.Stmt) -> tirx.Stmt:
        """One lock-step statement ``body`` of thread ``t``, for every thread, every access counted."""
        if n > _WARP * _WARPS:
            raise EmulationError(f"{self.name}: a block of {n} threads (at most {_WARP * _WARPS} counted)")
        loops = []      # a vector's elements are one access of the thread, not a loop
        tvm_ffi.structural_walk(body, (tirx.For, lambda f: loops.append(f) if EMULATED_VECTOR not in f.annotations
                                       else None))
        counter = self._counter(body, n) if loops else None
        if counter is not None:
            self.looped_segments.add(self.segment)
        instrumented = self._instrument(body, t, counter)
        bump = tirx.BufferStore(self.inst, tirx.BufferLoad(self.inst, [i64(0)]) + i64(1), [i64(0)])
        return seq([bump, tirx.For(t, i64(0), i64(n), tirx.ForKind.SERIAL, instrumented)])

    def barrier(self) -> tirx.Stmt:
        return tirx.Evaluate(i64(0))

    def after_allreduce(self, attr, thread_vars: dict) -> tirx.Stmt:
        return tirx.Evaluate(i64(0))

    def wrap(self, body: list) -> list:
        """The kernel's statements with the words and counts around them, and the report at the end."""
        pre = []
        arrays = [self.inst, self.requests, self.counts]
        arrays += [a for g in self.globals.values() for a in g.arrays()]
        arrays += [a for looped in self.looped for a in looped.arrays()]
        for buf in arrays:
            pre.append(tirx.AllocBuffer(buf))
            i = tirx.Var("z", _I64)
            pre.append(tirx.For(i, i64(0), buf.ty.shape[0], tirx.ForKind.SERIAL,
                                tirx.BufferStore(buf, tirx.const(0, str(buf.ty.dtype)), [i])))
        report = tirx.call_packed(REPORT, self.name, self.counts)
        return pre + list(body) + [tirx.Evaluate(report)]

    # -- the counts ---------------------------------------------------------------------------------
    def _counter(self, body, n: int) -> "_Looped":
        """Words for a statement that loops per thread: per (thread, site) how often the thread has
        run the site, per (warp, site) how many requests its lanes have made, in this instance."""
        sites = []
        tvm_ffi.structural_walk(body, [(tvm.ir.TensorLoad, lambda x: sites.append(x.source)),
                                       (tirx.BufferStore, lambda x: sites.append(x.buffer))])
        width = max(sum(1 for b in sites if b in self.globals or b in self.shared_copies), 1)
        looped = _Looped(len(self.looped), n, width)
        self.looped.append(looped)
        return looped

    def _instrument(self, stmt: tirx.Stmt, t: tirx.Var, counter) -> tirx.Stmt:
        def before(node, exprs):
            counts = [c for e in exprs for c in self._loads(e, t, counter)]
            return seq(counts + [node]) if counts else node

        def store(s):
            counts = [c for e in [s.value] + list(s.indices) for c in self._loads(e, t, counter)]
            counts += self._access(s.buffer, list(s.indices), _WRITE, t, None, counter)
            if s.buffer in self.shared_copies or s.buffer in self.globals:
                # A store outside its buffer (a kernel's bug) would overwrite the emulator's own
                # memory, these counts included: it is counted (``outside``) and not made.
                inside = tirx.const(True, "bool")
                for i, n in zip(s.indices, s.buffer.ty.shape):
                    inside = tirx.And(inside, tirx.And(as64(i) >= i64(0), as64(i) < as64(n)))
                # (a global access outside is counted with the access itself)
                skipped = self._count(len(self.names), FIELDS.index("outside")) if s.buffer in self.shared_copies else None
                s = tirx.IfThenElse(inside, s, skipped)
            return seq(counts + [s]) if counts else s

        return tvm_ffi.structural_map(stmt, [
            (tirx.BufferStore, store),
            (tirx.IfThenElse, lambda x: before(x, [x.condition])),
            (tirx.For, lambda x: before(x, [x.min, x.extent])),
            (tirx.Bind, lambda x: before(x, [x.value])),
            (tirx.Evaluate, lambda x: before(x, [x.value])),
        ])

    def _loads(self, expr, t, counter) -> list:
        found = guarded_loads(expr, lambda load: load.source in self.globals or load.source in self.shared_copies)
        return [c for load, guard in found for c in self._access(load.source, list(load.indices), _READ, t, guard,
                                                                 counter)]

    def _count(self, row: int, field: int, level: str = "segment") -> tirx.Stmt:
        at, width = {"segment": (self.segment, len(FIELDS)), "region": (self.region, len(DISTINCT)),
                     "call": (0, len(DISTINCT)), "group": (self.group, len(DISTINCT))}[level]
        slot = i64(self.offsets[level] + (at * (len(self.names) + 1) + row) * width + field)
        return tirx.BufferStore(self.counts, tirx.BufferLoad(self.counts, [slot]) + i64(1), [slot])

    def _flagged(self, flags, f, mode: int, row: int, level: str) -> list:
        """Count element ``f`` distinct at ``level`` where ``flags`` has not yet seen it (read: bit 1,
        written: bit 2)."""
        bit, was, zero = tirx.const(1 << mode, _FLAG), tirx.Var("was", _FLAG), tirx.const(0, _FLAG)
        return [tirx.Bind(was, tirx.BufferLoad(flags, [f])),
                tirx.IfThenElse(tirx.bitwise_and(was, bit) == zero,
                                seq([self._count(row, mode, level), tirx.BufferStore(flags, tirx.bitwise_or(was, bit), [f])]),
                                None),
                tirx.IfThenElse(was == zero, self._count(row, 2, level), None)]

    def _access(self, buf, indices: list, mode: int, t, guard, counter) -> list:
        if buf not in self.globals and buf not in self.shared_copies:
            return []
        if self.region < 0:
            raise EmulationError(f"{self.name}: an access outside any launch region")
        site = self.sites
        self.sites += 1
        if site >= _SITES:
            raise EmulationError(f"{self.name}: more than {_SITES} access sites to count")
        out = []
        stamp = tirx.Var("stamp", _I64)
        warp = tirx.floordiv(t, i64(_WARP))
        inst = tirx.BufferLoad(self.inst, [i64(0)])
        if counter is None:
            # lock step: the lanes of a warp run this site one after another, k = 0
            out.append(tirx.Bind(stamp, ((inst * i64(_WARPS) + warp) * i64(_SITES) + i64(site)) * i64(_KS) + i64(1)))
            new_request = tirx.BufferLoad(self.requests, [i64(site)]) != stamp
            take = [tirx.BufferStore(self.requests, stamp, [i64(site)])]
        else:
            kv = tirx.Var("k", _I64)
            out += counter.next_execution(t, warp, inst, kv)
            out.append(tirx.Bind(stamp, ((inst * i64(_WARPS) + warp) * i64(_SITES) + i64(site)) * i64(_KS)
                                 + tirx.Min(kv, i64(_KS - 2)) + i64(1)))
            new_request, take = counter.new_request(warp, kv)
        out_request = take
        if buf in self.shared_copies:
            row = len(self.names)
            req, acc = ((FIELDS.index("read_requests"), FIELDS.index("reads")) if mode == _READ
                        else (FIELDS.index("write_requests"), FIELDS.index("writes")))
            out += [tirx.IfThenElse(new_request, seq(out_request + [self._count(row, req)]), None),
                    self._count(row, acc)]
        else:
            g = self.globals[buf]
            f = tirx.Var("f", _I64)
            out.append(tirx.Bind(f, _flat(indices, g.shape)))
            counted = []                          # what an access inside the buffer updates
            out.append(tirx.IfThenElse(tirx.Or(f < i64(0), f >= i64(g.n)), self._count(g.index, 9), None))
            levels = [("call", 0), ("region", self.region), ("segment", self.segment)]
            if self.group >= 0:
                levels.append(("group", self.group))
            for level, at in levels:
                counted += self._flagged(g.flags(level, at), f, mode, g.index, level)
            req, sec, acc = (3, 4, 7) if mode == _READ else (5, 6, 8)
            sector = tirx.floordiv(f * i64(g.elem), i64(SECTOR))
            words = g.sectors(site)
            counted += [tirx.IfThenElse(tirx.BufferLoad(words, [sector]) != stamp,
                                        seq([tirx.BufferStore(words, stamp, [sector]), self._count(g.index, sec)]),
                                        None)]
            out += [tirx.IfThenElse(tirx.And(f >= i64(0), f < i64(g.n)), seq(counted), None),
                    tirx.IfThenElse(new_request, seq(out_request + [self._count(g.index, req)]), None),
                    self._count(g.index, acc)]
        return [tirx.IfThenElse(guard, seq(out), None)] if guard is not None else out
