"""The race checker's instrumentation of an emulated kernel (``runtime.races`` builds and runs it).

``emulate.emulate_primfunc(..., probe=Probe(name))`` calls the hooks below while it rewrites a
kernel for the CPU. Nothing here reads how the stitcher placed its barriers or why
(``stitch.dependence``): the checker looks only at the accesses the emulated kernel executes.

* **Barriers.** The kernel in launch form gets TVM's ThreadSync passes first (shared and
  shared.dyn), the ``__syncthreads()`` the CUDA build will insert, so that the barriers checked
  are the ones the GPU runs: ThreadSync's and the stitcher's. Grid syncs split phases.
* **Shadows.** Every global buffer the kernel writes (parameters and scratch) has, per element,
  a writer, a reader and an atomic-updater word for blocks (reset each grid-sync phase) and
  the same three for threads (reset each block-barrier interval); every shared buffer has the
  thread words. A word is ``stamp * 2**32 + who + 1`` (``MANY`` in the low half: several
  readers or atomic updaters); a word whose stamp is not the current phase (blocks) or barrier
  interval (threads: a counter bumped at each block start, each barrier and each cross-thread
  reduction over more than a warp) is empty, so nothing is cleared between phases, blocks or
  intervals.
* **Checks.** Before each access of a block (thread): a read conflicts with another's write or
  atomic update, a write with another's read, write or atomic update, an atomic update with
  another's read or write; atomic updates among themselves never conflict, and a write of the
  value another's write left there is counted apart (benign). Each finding is
  logged (``LOG_COLUMNS``) into a per-call log that the kernel hands to Python at its end
  (``souffle_tvm.races.report``); the count goes on past the log's capacity. A conflict is
  found whichever of its two accesses runs first, so the verdict does not depend on the
  order blocks or threads run in.
* **Orders.** Blocks of a phase run in the order of a table and threads of a lock-step
  statement in the order of another, both filled at the start of each call by Python
  (``souffle_tvm.races.order``): one compiled module runs ascending, descending or shuffled.
"""

from __future__ import annotations

import math

import tvm
import tvm_ffi
from tvm import s_tir, tirx

from ..errors import EmulationError
from ..te.rewrite import dtype_of
from ..stitch.kernel_ir import op_name
from .instrumented import as64, guarded_loads, i64, numel, on_flat_block, seq

REPORT, ORDER = "souffle_tvm.races.report", "souffle_tvm.races.order"
LOG_COLUMNS = ("code", "index", "word", "who", "block")     # a row of the log: see decode
LEVELS = {0: "blocks", 1: "threads"}
KINDS = {1: "read after write", 2: "write after read", 3: "write after write", 4: "plain access and atomic"}
_READ, _WRITE, _ATOMIC = "read", "write", "atomic"
_RAW, _WAR, _WAW, _ATOM = 1, 2, 3, 4
_ATOMIC_ADD = "tirx.cuda.atomic_add"          # CUDA's atomicAdd(&buf[i], v)
_MARK = "__souffle_race_atomic"               # marks an atomic update until the checks are in place
_I64, _SHIFT, MANY, _WARP = "int64", 2 ** 32, 2 ** 32 - 1, 32
_BUFFERS = 2 ** 16                            # tracked buffers per kernel, at most


def _buffer(shape: list, name: str) -> tirx.Var:
    return tirx.decl_buffer([i64(n) for n in shape], _I64, name, scope="global")


def _scope(buf) -> str:
    return str(buf.ty.storage_scope)


def _is_global(buf) -> bool:
    return _scope(buf) in ("global", "")


def _is_mark(value) -> bool:
    if op_name(value) != "tirx.call_pure_extern":
        return False
    name = value.args[0]
    return str(getattr(name, "value", name)) == _MARK


class _Shadows:
    """One tracked buffer's words: ``blocks`` and ``threads`` are (writer, reader, atomic or None)."""

    def __init__(self, ident: int, buf, for_blocks: bool, atomic: bool):
        self.id, self.shape = ident, [int(e) for e in buf.ty.shape]
        n = max(numel(buf), 1)

        def words(level):
            return tuple(_buffer([n], f"{buf.name}_{level}_{w}") for w in ("w", "r")) + \
                ((_buffer([n], f"{buf.name}_{level}_a"),) if atomic else (None,))
        self.blocks = words("b") if for_blocks else None
        self.threads = words("t")

    def arrays(self) -> list:
        return [a for level in (self.blocks, self.threads) if level is not None for a in level if a is not None]

    def flat(self, indices) -> tirx.PrimExpr:
        if len(indices) != len(self.shape):
            raise EmulationError(f"an access with {len(indices)} indices to a buffer of {len(self.shape)} dimensions")
        f = i64(0)
        for i, n in zip(indices, self.shape):
            f = f * i64(n) + as64(i)
        return f


class Probe:
    """The hooks ``emulate`` calls, for one kernel; ``names`` are its tracked buffers by id."""

    def __init__(self, name: str, capacity: int = 64):
        self.name, self.capacity = name, capacity
        self.names: list[str] = []
        self.tracked: dict = {}                  # buffer -> _Shadows
        self.epoch = _buffer([1], "race_epoch")  # the current block-barrier interval
        self.count = _buffer([len(LEVELS) + 1], "race_count")   # per level, then benign rewrites
        self.log = _buffer([len(LEVELS) * capacity * len(LOG_COLUMNS)], "race_log")
        self.tables: list = []                   # (kind, table) filled by ORDER at each call
        self.thread_tables: dict = {}            # thread count -> table
        self.phase_no = 0
        self.block = None                        # the current phase's flat block index (a Var)

    # -- before emulation ---------------------------------------------------------------------------
    def prepare(self, low: tirx.PrimFunc, target) -> tirx.PrimFunc:
        """The barriers the CUDA build will add (ThreadSync), atomics marked, buffers tracked."""
        mod = tvm.IRModule({self.name: low})
        with target:
            low = tvm.transform.Sequential([s_tir.transform.ThreadSync("shared"),
                                            s_tir.transform.ThreadSync("shared.dyn")])(mod)[self.name]
        atomic = []

        def mark(ev):
            call = ev.value
            if op_name(call) != _ATOMIC_ADD:
                return ev
            if op_name(call.args[0]) != "tirx.address_of" or not isinstance(call.args[0].args[0], tvm.ir.TensorLoad):
                raise EmulationError(f"{self.name}: an atomic add the race checker cannot read")
            target_ = call.args[0].args[0]
            atomic.append(target_.source)
            # buf[i] = MARK(v) until the checks are in; then buf[i] = buf[i] + v (see _instrument)
            value = tirx.call_pure_extern(dtype_of(target_), _MARK, call.args[1])
            return tirx.BufferStore(target_.source, value, list(target_.indices))
        body = tvm_ffi.structural_map(low.body, (tirx.Evaluate, mark))
        written = []
        tvm_ffi.structural_walk(body, (tirx.BufferStore, lambda s: written.append(s.buffer)))
        for buf in written:
            if _is_global(buf) and buf not in self.tracked:
                self._track(buf, True, any(a.same_as(buf) for a in atomic))
        return tirx.PrimFunc(low.params, body, attrs=low.attrs)

    def _track(self, buf, for_blocks: bool, atomic: bool = False) -> None:
        if len(self.names) >= _BUFFERS:
            raise EmulationError(f"{self.name}: more than {_BUFFERS} buffers to check for races")
        self.tracked[buf] = _Shadows(len(self.names), buf, for_blocks, atomic)
        self.names.append(str(buf.name))

    # -- hooks while emulating ------------------------------------------------------------------------
    def launch(self) -> None:
        """The next launch region starts: its phases are numbered on from the last one's."""

    def stage(self) -> None:
        """The next stitched stage loop starts: races are checked across stages alike."""

    def shared(self, buf) -> None:
        """A block's copy of a shared buffer: checked between its threads only."""
        self._track(buf, False)

    def phase(self, blocks: dict, run) -> tirx.Stmt:
        """One grid-sync phase: ``run()`` emulates one block; it runs for every block, in table order."""
        self.phase_no += 1
        self.block = tirx.Var(f"block{self.phase_no}", _I64)
        body, n = on_flat_block(self.block, blocks, run())
        table = self._table("blocks", n)
        i = tirx.Var("i", _I64)
        return tirx.For(i, i64(0), i64(n), tirx.ForKind.SERIAL,
                        seq([tirx.Bind(self.block, tirx.BufferLoad(table, [i])), self.barrier(), body]))

    def threads(self, t: tirx.Var, n: int, body: tirx.Stmt) -> tirx.Stmt:
        """One lock-step statement ``body`` of thread ``t``, for every thread in table order."""
        if n not in self.thread_tables:
            self.thread_tables[n] = self._table("threads", n)
        i = tirx.Var("ti", _I64)
        return tirx.For(i, i64(0), i64(n), tirx.ForKind.SERIAL,
                        seq([tirx.Bind(t, tirx.BufferLoad(self.thread_tables[n], [i])), self._instrument(body, t)]))

    def barrier(self) -> tirx.Stmt:
        """A new barrier interval: what threads touched before it no longer conflicts."""
        return tirx.BufferStore(self.epoch, tirx.BufferLoad(self.epoch, [i64(0)]) + i64(1), [i64(0)])

    def after_allreduce(self, attr, thread_vars: dict) -> tirx.Stmt:
        """A cross-thread reduction over more than a warp is lowered with ``__syncthreads()``
        between its steps (LowerThreadAllreduce); within a warp it synchronises nothing else."""
        calls = []
        tvm_ffi.structural_walk(attr.body, (tvm.ir.Call, lambda c: calls.append(c)
                                            if op_name(c) == "tirx.tvm_thread_allreduce" else None))
        used = set()
        for e in (calls[0].args[4:] if calls else []):
            tvm_ffi.structural_walk(e, (tirx.Var, lambda v: used.add(v) if v in thread_vars else None))
        span = math.prod(thread_vars[v][1] for v in used) if used else 1
        return self.barrier() if span > _WARP else tirx.Evaluate(i64(0))

    def wrap(self, body: list) -> list:
        """The kernel's statements with the shadows, the order tables and the report around them."""
        pre = []
        for buf, init in [(self.epoch, 0), (self.count, 0), (self.log, None)] + \
                [(a, 0) for sh in self.tracked.values() for a in sh.arrays()] + [(t, None) for _, t in self.tables]:
            pre.append(tirx.AllocBuffer(buf))
            if init is not None:
                i = tirx.Var("z", _I64)
                pre.append(tirx.For(i, i64(0), buf.ty.shape[0], tirx.ForKind.SERIAL,
                                    tirx.BufferStore(buf, i64(init), [i])))
        pre += [tirx.Evaluate(tirx.call_packed(ORDER, kind, table)) for kind, table in self.tables]
        return pre + list(body) + [tirx.Evaluate(tirx.call_packed(REPORT, self.name, self.count, self.log))]

    # -- the checks ---------------------------------------------------------------------------------
    def _table(self, kind: str, n: int) -> tirx.Var:
        table = _buffer([n], f"race_{kind}_{len(self.tables)}")
        self.tables.append((kind, table))
        return table

    def _instrument(self, stmt: tirx.Stmt, t: tirx.Var) -> tirx.Stmt:
        """``stmt`` (one thread's) with every access of a tracked buffer checked just before it."""
        def before(node, exprs, then):
            checks = [c for e in exprs for c in self._reads(e, t)]
            return seq(checks + [then]) if checks else then

        def store(s):
            value, mode = s.value, _WRITE
            if _is_mark(value):      # atomicAdd: its own load of the target is part of the update
                value, mode = value.args[1], _ATOMIC
            checks = [c for e in [value] + list(s.indices) for c in self._reads(e, t)]
            if mode == _ATOMIC:
                value = tirx.BufferLoad(s.buffer, list(s.indices)) + value
            same = None
            if s.buffer in self.tracked and mode == _WRITE:     # the value, to tell a same-value rewrite
                v = tirx.Var("v", dtype_of(value))
                checks.append(tirx.Bind(v, value))
                value, same = v, tirx.BufferLoad(s.buffer, list(s.indices)) == v
            if s.buffer in self.tracked:
                checks += self._access(s.buffer, list(s.indices), mode, t, None, same)
            out = tirx.BufferStore(s.buffer, value, list(s.indices))
            return seq(checks + [out]) if checks else out

        return tvm_ffi.structural_map(stmt, [
            (tirx.BufferStore, store),
            (tirx.IfThenElse, lambda x: before(x, [x.condition], x)),
            (tirx.For, lambda x: before(x, [x.min, x.extent], x)),
            (tirx.Bind, lambda x: before(x, [x.value], x)),
            (tirx.Evaluate, lambda x: before(x, [x.value], x)),
        ])

    def _reads(self, expr, t) -> list:
        """Checks for the tracked loads in ``expr``, each under the condition it is evaluated on."""
        found = guarded_loads(expr, lambda load: load.source in self.tracked)
        return [c for load, guard in found for c in self._access(load.source, list(load.indices), _READ, t, guard)]

    def _access(self, buf, indices: list, mode: str, t, guard, same=None) -> list:
        """Check one access at both levels: conflicts logged, then the words updated. ``same``
        (writes): whether the value written is the one already there."""
        sh = self.tracked[buf]
        f, e = tirx.Var("f", _I64), tirx.Var("e", _I64)
        out = [tirx.Bind(f, sh.flat(indices))]
        if sh.blocks is not None:
            out += self._words(sh, sh.blocks, f, i64(self.phase_no), self.block, mode, 0, same)
        out.append(tirx.Bind(e, tirx.BufferLoad(self.epoch, [i64(0)])))
        out += self._words(sh, sh.threads, f, e, t, mode, 1, same)
        return [tirx.IfThenElse(guard, seq(out), None)] if guard is not None else out

    def _words(self, sh: _Shadows, words: tuple, f, stamp, who, mode: str, level: int, same=None) -> list:
        """Check and update one level's words at element ``f`` for an access of ``who``. A write
        over another's write of the same value (threads each storing the result they all
        computed) is counted apart, as benign: whichever lands, memory holds that value."""
        w_buf, r_buf, a_buf = words
        if mode == _ATOMIC and a_buf is None:
            raise EmulationError(f"{self.name}: an atomic update of {self.names[sh.id]} (only global ones are modelled)")
        key = stamp * i64(_SHIFT) + who + i64(1)
        many = stamp * i64(_SHIFT) + i64(MANY)
        out = []

        def word(buf, name):
            v = tirx.Var(name, _I64)
            out.append(tirx.Bind(v, tirx.BufferLoad(buf, [f])))
            return v

        def conflict(v, kind, benign=None):
            cond = tirx.And(tirx.floordiv(v, i64(_SHIFT)) == stamp, v != key)
            found = self._record(level, kind, sh.id, f, v, who)
            if benign is not None:
                slot = [i64(len(LEVELS))]
                found = tirx.IfThenElse(benign, tirx.BufferStore(self.count, tirx.BufferLoad(self.count, slot) + i64(1),
                                                                 slot), found)
            out.append(tirx.IfThenElse(cond, found, None))

        def join(buf, v):        # who joins the readers (atomic updaters): one, or MANY
            out.append(tirx.BufferStore(buf, tirx.Select(tirx.floordiv(v, i64(_SHIFT)) != stamp, key,
                                                         tirx.Select(v == key, key, many)), [f]))
        w = word(w_buf, "w")
        a = word(a_buf, "a") if a_buf is not None else None
        if mode == _READ:
            conflict(w, _RAW)
            if a is not None:
                conflict(a, _ATOM)
            join(r_buf, word(r_buf, "r"))
        elif mode == _WRITE:
            conflict(w, _WAW, same)
            conflict(word(r_buf, "r"), _WAR)
            if a is not None:
                conflict(a, _ATOM)
            out.append(tirx.BufferStore(w_buf, key, [f]))
        else:
            conflict(w, _ATOM)
            conflict(word(r_buf, "r"), _ATOM)
            join(a_buf, a)
        return out

    def _record(self, level: int, kind: int, buf_id: int, f, word, who) -> tirx.Stmt:
        """Count a conflict; log it (``LOG_COLUMNS``; ``word`` is the other's) while the log has room."""
        c = tirx.Var("c", _I64)
        code = ((self.phase_no * 2 + level) * 8 + kind) * _BUFFERS + buf_id
        row = [i64(code), f, word, who, self.block]
        width = len(LOG_COLUMNS)
        base = level * self.capacity * width
        stores = [tirx.BufferStore(self.log, v, [c * i64(width) + i64(base + k)]) for k, v in enumerate(row)]
        return seq([tirx.Bind(c, tirx.BufferLoad(self.count, [i64(level)])),
                     tirx.IfThenElse(c < i64(self.capacity), seq(stores), None),
                     tirx.BufferStore(self.count, c + i64(1), [i64(level)])])


def decode(row) -> dict:
    """A log row as ``level`` (LEVELS), ``kind`` (KINDS), ``buffer`` (id), ``index``, ``phase``
    (1-based), ``other`` (-1: several), ``who``, ``block``."""
    code, index, word, who, block = (int(x) for x in row)
    code, buf = divmod(code, _BUFFERS)
    code, kind = divmod(code, 8)
    phase, level = divmod(code, 2)
    low = word % _SHIFT
    return {"level": level, "kind": kind, "buffer": buf, "index": index, "phase": phase,
            "other": -1 if low == MANY else low - 1, "who": who, "block": block}
