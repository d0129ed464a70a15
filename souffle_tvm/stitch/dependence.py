"""Which barrier a stitched stage needs before it, proved from the stages' index maps.

A stitched kernel runs stage after stage on the same grid; virtual block ``vb`` of every stage
runs on physical block ``(vb + lane) % G``, in program order (``lane`` 0 unless the stage runs
beside others of its wave, ``waves``; stages on different lanes never share a block's view of
``vb``, so a dependence between them keeps its grid sync). So a stage that reads only what the *same*
virtual block of an earlier stage wrote needs no grid-wide barrier: a block barrier
(``__syncthreads``, which also orders the block's global-memory accesses) is enough, and none
at all when each thread reads only what it wrote itself.

The proof works on a stage body in *vb form*: its block indices expressed through one symbolic
virtual block ``vb`` and its thread indices through ``tid``. For the writer, an unguarded store
whose indices are a surjective affine map of the iterators below ``vb`` (TVM's
``detect_iter_map``) writes exactly a dense box whose corner depends only on ``vb`` (several
threads may store one element: ``ColumnReduction``'s rows of threads each store the same sum); the reader
is block-local when every load of the buffer, bounded over its own iterators
(``Analyzer.int_set``), provably stays inside that box for every ``vb`` it runs. Anything the
analysis cannot see through (a guarded or data-dependent store, a let-bound index, a non-affine
map, more reader blocks than writer blocks) keeps the grid sync: the proof may be incomplete,
never unsound. Where writer and reader have one virtual block each, block 0 runs both, so a
block barrier suffices whatever the stores' form (a one-block tail: MMoE's gates and towers).
Indices are read in int64 throughout (``_i64``): lowering leaves int32 casts the analysis
cannot see through. It assumes what every schedule here guarantees: a stage writes each element
of an output from one block (no split-K across blocks); write-after-read and write-after-write
between stages always get a grid sync (``kernel.stitch``).
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
import tvm.sym as arith
import tvm_ffi
from tvm import tirx

from ..te.rewrite import uses

GRID, BLOCK, NONE = "grid", "block", "none"     # the barrier a dependence needs, strongest first
_ORDER = {NONE: 0, BLOCK: 1, GRID: 2}

VB = tirx.Var("vb", "int64")                     # the virtual block index of vb-form bodies


def stronger(a: str, b: str) -> str:
    return a if _ORDER[a] >= _ORDER[b] else b


@dataclass
class StageView:
    """A stage in vb form: ``body`` uses ``VB`` for its block and ``tid`` for its thread."""

    body: tirx.Stmt
    tid: tirx.Var
    blocks: int          # vb runs over [0, blocks)
    threads: int         # tid runs over [0, threads)
    lane: int = 0        # the physical block its vb 0 runs on (``waves``): vb runs on (vb + lane) % G


@dataclass
class _Access:
    indices: list
    loops: dict          # enclosing loop var -> Range, inside the stage
    guarded: bool        # under a condition (or a construct the walk does not model)


def _accesses(body, buf) -> tuple[list[_Access], list[_Access]]:
    """Stores to and loads of ``buf`` in ``body``, with their enclosing loops."""
    stores, loads = [], []

    def loads_in(expr, loops, guarded):
        tvm_ffi.structural_walk(expr, (tvm.ir.TensorLoad, lambda x: loads.append(_Access(list(x.indices), loops, guarded))
                                       if x.source.same_as(buf) else None))

    def visit(node, loops, guarded):
        if isinstance(node, tirx.SeqStmt):
            for s in node.seq:
                visit(s, loops, guarded)
        elif isinstance(node, tirx.For):
            loads_in(node.min, loops, guarded)
            loads_in(node.extent, loops, guarded)
            visit(node.body, {**loops, node.loop_var: tvm.ir.Range.from_min_extent(node.min, node.extent)}, guarded)
        elif isinstance(node, tirx.IfThenElse):
            loads_in(node.condition, loops, guarded)
            visit(node.then_case, loops, True)
            if node.else_case is not None:
                visit(node.else_case, loops, True)
        elif isinstance(node, tirx.AttrStmt):
            loads_in(node.value, loops, guarded)
            visit(node.body, loops, guarded)
        elif isinstance(node, tirx.BufferStore):
            loads_in(node.value, loops, guarded)
            for i in node.indices:
                loads_in(i, loops, guarded)
            if node.buffer.same_as(buf):
                stores.append(_Access(list(node.indices), loops, guarded))
        elif isinstance(node, (tirx.Evaluate, tirx.AllocBuffer, tirx.DeclBuffer)):
            loads_in(node, loops, guarded)
            if any(b.same_as(buf) for b in atomic_targets(node)):   # writes, but proves no ownership
                stores.append(_Access([], loops, True))
        else:   # anything else (let bindings, while loops...): its stores prove nothing
            loads_in(node, loops, True)
            tvm_ffi.structural_walk(node, (tirx.BufferStore, lambda s: stores.append(_Access(list(s.indices), loops, True))
                                           if s.buffer.same_as(buf) else None))

    visit(body, {}, False)
    return stores, loads


_ARITH = (tirx.Add, tirx.Sub, tirx.Mul, tirx.FloorDiv, tirx.FloorMod, tirx.Min, tirx.Max)
_INDEX = ("int32", "int64")


def _is_index(e) -> bool:
    return str(e.ty.dtype) in _INDEX


def _i64(e, names: dict | None = None):
    """``e`` computed in int64 throughout: its int32 casts and constants widened, its int32
    variables renamed through ``names`` (old -> int64 var). Index arithmetic fits in 32 bits (the
    buffers do), so the value is the same; the iterator analysis cannot see through a cast
    (``int32(tid % 16) // 8``, what lowering leaves in a stage's indices) nor take an int32
    iterator under a cast."""
    names = {} if names is None else names
    if isinstance(e, tirx.IntImm):
        return tirx.const(int(e.value), "int64")
    if isinstance(e, tirx.Cast) and _is_index(e) and _is_index(e.value):    # int8, uint32...: opaque
        return _i64(e.value, names)
    if isinstance(e, tirx.Var) and str(e.ty.dtype) != "int64":
        return names[e] if e in names else tirx.Cast("int64", e)
    if isinstance(e, _ARITH) and _is_index(e):
        return type(e)(_i64(e.a, names), _i64(e.b, names))
    return e if str(e.ty.dtype) == "int64" else tirx.Cast("int64", e)


def _wide_indices(indices: list, names: dict) -> list | None:
    """``indices`` through ``_i64``; None where a renamed loop variable is left in one (under a
    node ``_i64`` does not rebuild: a truncating division, a select, a load), which would be a
    free symbol to the analysis beside its renamed self: such an access proves nothing."""
    out = [_i64(i, names) for i in indices]
    return None if names and any(uses(i, names) for i in out) else out


def _wide_loops(loops: dict) -> tuple[dict, dict]:
    """``loops`` (var -> Range) with int64 variables and bounds, and the renaming of the int32
    ones for ``_i64``."""
    names = {v: tirx.Var(v.name, "int64") for v in loops if str(v.ty.dtype) != "int64"}
    return {names.get(v, v): tvm.ir.Range.from_min_extent(_i64(r.min, names), _i64(r.extent, names))
            for v, r in loops.items()}, names


def _bounded(access: _Access) -> tuple[dict, list] | None:
    """An access's loops as intervals and its indices, both in int64; None where an index
    proves nothing (``_wide_indices``)."""
    loops, names = _wide_loops(access.loops)
    indices = _wide_indices(access.indices, names)
    if indices is None:
        return None
    return {v: arith.IntervalSet(r.min, r.min + r.extent - 1) for v, r in loops.items()}, indices


def _box(store: _Access, view: StageView, per_thread: bool) -> list | None:
    """The dense box ``[(base, extent)]`` an unguarded store writes for one vb (and one tid)."""
    if store.guarded:
        return None
    iters, names = _wide_loops(store.loops)
    if not per_thread:
        iters[view.tid] = tvm.ir.Range.from_min_extent(tirx.const(0, "int64"), tirx.const(view.threads, "int64"))
    if not all(isinstance(r.extent, tirx.IntImm) for r in iters.values()):
        return None
    indices = _wide_indices(store.indices, names)
    if indices is None:
        return None
    try:
        res = arith.detect_iter_map(indices, iters, True, "surjective")
    except Exception:   # noqa: BLE001 - an index form the iterator analysis rejects proves nothing
        return None
    if len(res.errors) or len(res.indices) != len(store.indices):
        return None
    box = []
    for s in res.indices:
        if len(s.args) == 0:
            box.append((s.base, 1))
        elif len(s.args) == 1 and isinstance(s.args[0].scale, tirx.IntImm) and int(s.args[0].scale) == 1:
            box.append((s.base, s.args[0].extent))
        else:
            return None
    return box


def _inside(load: _Access, box: list, view: StageView, per_thread: bool) -> bool:
    ana = arith.Analyzer()
    ana.bind(VB, tvm.ir.Range.from_min_extent(tirx.const(0, "int64"), tirx.const(view.blocks, "int64")))
    bounded = _bounded(load)
    if bounded is None:
        return False
    dom, indices = bounded
    if per_thread:
        ana.bind(view.tid, tvm.ir.Range.from_min_extent(tirx.const(0, "int64"), tirx.const(view.threads, "int64")))
    else:
        dom[view.tid] = arith.IntervalSet(tirx.const(0, "int64"), tirx.const(view.threads - 1, "int64"))
    for idx, (base, ext) in zip(indices, box):
        s = ana.int_set(idx, dom)
        if not (ana.can_prove(s.min_value >= base) and ana.can_prove(s.max_value <= base + ext - 1)):
            return False
    return True


def barrier_needed(writer: StageView, wbuf, reader: StageView, rbuf) -> str:
    """The weakest barrier that makes ``reader``'s loads of ``rbuf`` see ``writer``'s stores to
    ``wbuf`` (the same global buffer under each stage's own name): NONE, BLOCK or GRID."""
    _, loads = _accesses(reader.body, rbuf)
    if not loads:
        return NONE
    if reader.blocks > writer.blocks:       # some reader blocks have no writer block of their own
        return GRID
    if reader.lane != writer.lane:          # one vb runs on different blocks in the two stages
        return GRID
    stores, _ = _accesses(writer.body, wbuf)
    levels = ((NONE, True), (BLOCK, False)) if reader.threads <= writer.threads else ((BLOCK, False),)
    for level, per_thread in levels:
        boxes = [b for s in stores for b in [_box(s, writer, per_thread)] if b is not None]
        if boxes and all(any(_inside(ld, b, reader, per_thread) for b in boxes) for ld in loads):
            return level
    # one virtual block each: block 0 made every element there is, whatever its stores' form
    # (true by construction: the static check, which asks this function, cannot refute it)
    return BLOCK if writer.blocks == reader.blocks == 1 else GRID


def covering_box(writer: StageView, buf, readers: list[tuple[StageView, object]], block: int = 0,
                 dual: bool = False) -> list | None:
    """One box ``[(base, extent)]`` per virtual block of ``writer`` holding every access the
    writer makes to ``buf`` and every load of each reader (``(view, its name for buf)``), with
    constant extents; None if no store's box does (or an access is not a plain scalar one).

    What the on-chip channel (``channel``) sizes a per-block buffer by: a store's dense box
    (``_box``), checked to contain the writer's other stores and loads too (a reduction's
    update reads and writes what its init wrote) and the readers' loads."""
    stores, loads = _accesses(writer.body, buf)
    accesses = [(a, writer) for a in stores + loads]
    for view, rbuf in readers:
        accesses += [(a, view) for a in _accesses(view.body, rbuf)[1]]
    if not stores or any(not a.indices or any("x" in str(i.ty) for i in a.indices) for a, _ in accesses):
        return None       # atomics (no indices) or vector accesses: not rebased here
    # the one block holds it all, where every stage spans the block's threads and touches the
    # tensor under no ``if`` (a guard, ``tid < n`` around a narrower stage) in more than one
    # statement: TVM's ThreadSync cannot put a barrier inside a condition
    views = [(writer, buf)] + readers
    if (writer.blocks == 1 and all(v.threads == block and guards_one_statement(v.body, b, dual and v is writer)
                                   for v, b in views)
            and all(isinstance(d, tirx.IntImm) for d in buf.shape)):
        return [(tirx.const(0, "int64"), int(d)) for d in buf.shape]
    for s in stores:
        box = _box(s, writer, False)
        if box is None or not all(isinstance(e, (int, tirx.IntImm)) for _, e in box):
            continue
        if all(_inside(a, box, view, False) for a, view in accesses):
            return box
    return None


def guards_one_statement(body, buf, dual: bool = False) -> bool:
    """Does every ``if`` of ``body`` that touches ``buf`` do so in one statement, outside any loop
    of its own? Then ThreadSync never needs a barrier on ``buf`` inside the condition (it orders
    statements, and its loop-carried check is what a loop would add), which it cannot insert
    ("Cannot insert syncs inside condition"): the barriers a shared ``buf`` needs go between
    stages, where the stitcher puts them. ``dual``: ``body`` writes the channel and the global
    tensor both (``channel.rebase``), so a store there is taken as two statements."""
    def weight(leaf) -> int:
        stores, loads = _accesses(leaf, buf)
        return (2 if dual else 1) if stores else 1 if loads else 0

    ifs: list = []
    tvm_ffi.structural_walk(body, (tirx.IfThenElse, ifs.append))
    for node in ifs:
        for branch in (node.then_case, node.else_case):
            touching = [(weight(leaf), looped) for leaf, looped in _leaves(branch) if weight(leaf)]
            if sum(w for w, _ in touching) > 1 or any(looped for _, looped in touching):
                return False
    return True


def _leaves(node, looped: bool = False):
    """The statements of ``node`` below its sequences, loops, conditions and attributes, each
    with whether a loop of ``node`` encloses it."""
    if node is None:
        return
    if isinstance(node, tirx.SeqStmt):
        for x in node.seq:
            yield from _leaves(x, looped)
    elif isinstance(node, tirx.For):
        yield from _leaves(node.body, True)
    elif isinstance(node, tirx.IfThenElse):
        yield from _leaves(node.then_case, looped)
        yield from _leaves(node.else_case, looped)
    elif isinstance(node, tirx.AttrStmt):
        yield from _leaves(node.body, looped)
    else:
        yield node, looped


def read_box(readers: list[tuple[StageView, object]], shape: list[int]) -> list | None:
    """One box ``[(base, extent)]`` per virtual block holding every load each reader (``(view, its
    name for the buffer)``) makes of a buffer of ``shape``, with constant extents and inside the
    buffer for every virtual block; None if there is none (a load unbounded over its loops and
    threads, a corner that moves other than with ``VB``, a vector or address access).

    The loads are bounded over their loops and threads, guards ignored: the box may hold more
    than a block reads, never less (what ``resident`` fills a block's copy of a weight with)."""
    ana = arith.Analyzer()
    ana.bind(VB, tvm.ir.Range.from_min_extent(tirx.const(0, "int64"), tirx.const(readers[0][0].blocks, "int64")))
    bounds = []          # per load: per dimension (lowest, highest index), in VB
    for view, buf in readers:
        stores, loads = _accesses(view.body, buf)
        if stores or not loads or any(not ld.indices or any("x" in str(i.ty) for i in ld.indices) for ld in loads):
            return None
        for ld in loads:
            bounded = _bounded(ld)
            if bounded is None:
                return None
            dom, indices = bounded
            dom[view.tid] = arith.IntervalSet(tirx.const(0, "int64"), tirx.const(view.threads - 1, "int64"))
            sets = [ana.int_set(idx, dom) for idx in indices]
            bounds.append([(s.min_value, s.max_value) for s in sets])
    box = []
    for d, size in enumerate(shape):
        base = ana.simplify(bounds[0][d][0])
        offsets = [(ana.simplify(lo - base), ana.simplify(hi - base)) for lo, hi in (b[d] for b in bounds)]
        if not all(isinstance(x, tirx.IntImm) for pair in offsets for x in pair):
            return None
        low, high = min(int(lo) for lo, _ in offsets), max(int(hi) for _, hi in offsets)
        corner = ana.simplify(base + tirx.const(low, "int64"))
        extent = high - low + 1
        if not (ana.can_prove(corner >= 0) and ana.can_prove(corner + extent <= size)):
            return None       # (a guarded tile at the buffer's edge: its guard is not read here)
        box.append((corner, extent))
    return box


ATOMIC_ADD = "tirx.cuda.atomic_add"


def atomic_targets(node) -> list:
    """The buffers ``node`` updates with ``atomicAdd(&buf[...], v)`` (writes no BufferStore shows)."""
    out = []

    def visit(call):
        if getattr(call.op, "name", "") != ATOMIC_ADD:
            return
        addr = call.args[0]
        if getattr(addr.op, "name", "") == "tirx.address_of" and isinstance(addr.args[0], tvm.ir.TensorLoad):
            out.append(addr.args[0].source)

    tvm_ffi.structural_walk(node, (tvm.ir.Call, visit))
    return out


def block_barrier() -> tirx.Stmt:
    """``__syncthreads()``: orders the block's shared *and* global memory accesses."""
    return tirx.Evaluate(tirx.call_intrin("int32", "tirx.tvm_storage_sync", "shared"))


def is_block_barrier(stmt) -> bool:
    return (isinstance(stmt, tirx.Evaluate) and isinstance(stmt.value, tvm.ir.Call)
            and getattr(stmt.value.op, "name", "") == "tirx.tvm_storage_sync")
