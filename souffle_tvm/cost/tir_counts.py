"""What one block of a lowered device kernel executes, counted from its TIR: the facts the static
floors (``cost.floors``) read.

Counts are lower bounds, so the floors stay floors:
* a loop runs its extent; an extent that depends on the block (a stitched kernel's grid-stride
  trip) is taken at the last block, which has the fewest trips (and again at block 0, which
  has the most: ``BlockCounts.busiest``); one that cannot be evaluated counts once;
* a branch on the thread index runs in the warps that hold a thread taking it (evaluated for
  every thread of the block); a branch marked ``likely`` (TVM's bound checks) is taken; any
  other branch, and the branches of an ``if_then_else`` expression, count nothing;
* a shared access of ``b`` bytes per lane costs its warp ``b / 16`` wavefronts (the widest
  vector access, every lane on the same address); ``ldmatrix`` of ``n`` 8x8 matrices ``n``;
* a global access (load or store) is one request per warp, touching the distinct 32-byte
  sectors its active lanes' addresses fall in, evaluated at the first iteration of every
  enclosing loop (an affine index moves all lanes together, so the pattern repeats; the first
  iteration is the aligned one). An address that cannot be evaluated (a gathered index, a
  ``cp.async``) counts as coalesced: its lanes' bytes over 32;
* an unpipelined K step is a serial or unrolled loop's iteration that stores a global load in
  shared memory and waits at a barrier, or, where TVM unrolled a short K loop away, each of two
  or more such store-then-barrier segments in one statement sequence (one alone is a single
  wait, which a wave's ``latency_us`` already covers: not a chain).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import tvm
import tvm_ffi
from tvm import tirx

from . import tir_stats
from .work import SECTOR_BYTES, WAVEFRONT_BYTES, WIDEST_LANE_ACCESS, BlockCounts

_THREADS = ("threadIdx.x", "threadIdx.y", "threadIdx.z")


class _Unknown(Exception):
    pass


def _op(call) -> str:
    return str(getattr(call.op, "name", ""))


def _scope(buf) -> str:
    return str(buf.ty.storage_scope or "global")


def _lane_bytes(buffer, indices) -> int:
    """Bytes one lane moves accessing ``buffer`` at ``indices`` (a ``Ramp`` index: a vector)."""
    lanes = math.prod(int(i.lanes) for i in indices if isinstance(i, tirx.Ramp))
    return tir_stats.dtype_bytes(str(buffer.ty.dtype)) * lanes


_BINARY = {tirx.Add: np.add, tirx.Sub: np.subtract, tirx.Mul: np.multiply, tirx.FloorDiv: np.floor_divide,
           tirx.FloorMod: np.mod, tirx.Div: np.floor_divide, tirx.Mod: np.mod, tirx.Min: np.minimum,
           tirx.Max: np.maximum, tirx.LT: np.less, tirx.LE: np.less_equal, tirx.GT: np.greater,
           tirx.GE: np.greater_equal, tirx.EQ: np.equal, tirx.NE: np.not_equal, tirx.And: np.logical_and,
           tirx.Or: np.logical_or}


class _Walk:
    """One pass over a kernel's body, carrying how many times (``trips``) and in how many warps
    (``warps``, a boolean mask over the block's warps) each statement runs."""

    def __init__(self, first_block: bool = False):
        self.first_block = first_block
        self.extents: dict[str, int] = {}
        self.env: dict = {}                 # var -> value (numpy over the block's threads, or int)
        self.thread_vars: list = []
        self.loop_vars: set = set()         # taken at their first iteration, for addresses only
        self.lets: dict = {}                # var -> value, where it needs a loop variable
        self.shared = 0.0
        self.requests = self.sectors = 0.0
        self.k_steps = self.pipelined = self.barriers = 0
        self.in_k_loop = 0                  # inside a loop whose iterations are counted as K steps

    # -- evaluation over the block's threads ---------------------------------------------------
    def _thread_ids(self) -> dict[str, np.ndarray]:
        x, y, z = (self.extents.get(t, 1) for t in _THREADS)
        tid = np.arange(x * y * z)
        return {"threadIdx.x": tid % x, "threadIdx.y": tid // x % y, "threadIdx.z": tid // (x * y)}

    def eval(self, e, first: bool = False):
        """``e``'s value over the block's threads; with ``first``, loop variables at their first
        iteration (addresses only: branches and extents must not assume an iteration)."""
        if isinstance(e, tirx.IntImm):
            return int(e.value)
        if isinstance(e, tirx.Var):
            if e in self.env:
                return self.env[e]
            if first and e in self.loop_vars:
                return 0
            if first and e in self.lets:
                return self.eval(self.lets[e], first)
            raise _Unknown
        if isinstance(e, tirx.Cast):
            return self.eval(e.value, first)
        if isinstance(e, tirx.Not):
            return np.logical_not(self.eval(e.a, first))
        if type(e) in _BINARY:
            return _BINARY[type(e)](self.eval(e.a, first), self.eval(e.b, first))
        if isinstance(e, tirx.Select):
            return np.where(self.eval(e.condition, first), self.eval(e.true_value, first),
                            self.eval(e.false_value, first))
        if isinstance(e, tvm.ir.Call) and _op(e).endswith("likely"):
            return self.eval(e.args[0], first)
        raise _Unknown

    def global_access(self, buffer, indices, trips: int, mask) -> None:
        """Count one global access per active warp: its request and the distinct sectors its lanes
        touch (at the first iteration of the enclosing loops)."""
        active = self._warps(mask)
        warps = int(active.sum())
        if not warps:
            return
        elem = tir_stats.dtype_bytes(str(buffer.ty.dtype))
        self.requests += trips * warps
        try:
            if len(indices) != 1:
                raise _Unknown
            index = indices[0]
            if isinstance(index, tirx.Ramp):
                base, stride, lanes = self.eval(index.base, True), self.eval(index.stride, True), int(index.lanes)
            else:
                base, stride, lanes = self.eval(index, True), 0, 1
        except _Unknown:
            self.sectors += trips * warps * math.ceil(32 * _lane_bytes(buffer, indices) / SECTOR_BYTES)
            return
        per_thread = np.broadcast_to(np.asarray(base, dtype=np.int64), (self.threads,))
        offsets = per_thread[:, None] + np.asarray(stride, dtype=np.int64) * np.arange(lanes)[None, :]
        first = offsets * elem // SECTOR_BYTES
        last = (offsets * elem + elem - 1) // SECTOR_BYTES
        live = np.broadcast_to(mask, (self.threads,))
        for w in np.flatnonzero(active):
            lanes_ = slice(32 * w, min(32 * w + 32, self.threads))
            keep = live[lanes_]
            self.sectors += trips * len(np.union1d(first[lanes_][keep], last[lanes_][keep]))

    def _extent(self, e) -> int:
        try:
            v = self.eval(e)
        except _Unknown:
            # a guarded stage (``stitch.ramps``: a trip count that is zero at most iterations of
            # its wave loop) counts at its fewest, none: these are lower bounds
            return min(self._extent(e.true_value), self._extent(e.false_value)) if isinstance(e, tirx.Select) else 1
        return int(np.min(v)) if isinstance(v, np.ndarray) else int(v)

    def _warps(self, mask) -> np.ndarray:
        warps = math.ceil(self.threads / 32)
        padded = np.zeros(warps * 32, dtype=bool)
        padded[:self.threads] = np.broadcast_to(mask, (self.threads,))
        return padded.reshape(warps, 32).any(axis=1)

    @property
    def threads(self) -> int:
        return math.prod(self.extents.get(t, 1) for t in _THREADS)

    # -- expressions ---------------------------------------------------------------------------
    def expr(self, e, trips: int, warps: int, mask=None) -> tuple[bool, bool]:
        """Count ``e``'s shared and global accesses; (loads global memory, loads shared memory)."""
        skipped: list = []
        found = {"global": False, "shared": False}

        def branchy(c):
            if _op(c).endswith("if_then_else"):
                for arg in c.args[1:]:
                    tvm_ffi.structural_walk(arg, (tvm.ir.TensorLoad, skipped.append))

        tvm_ffi.structural_walk(e, (tvm.ir.Call, branchy))

        def load(ld):
            if any(ld.same_as(s) for s in skipped):
                return
            scope = _scope(ld.source)
            if scope == "global":
                found["global"] = True
                if mask is not None:
                    self.global_access(ld.source, ld.indices, trips, mask)
            elif scope.startswith("shared"):
                found["shared"] = True
                self.shared += trips * warps * _lane_bytes(ld.source, ld.indices) / WIDEST_LANE_ACCESS

        def call(c):
            name = _op(c)
            if name.endswith("ptx_ldmatrix"):
                self.shared += trips * warps * int(c.args[1].value)
            elif name.endswith("tvm_load_matrix_sync"):
                self.shared += trips * warps * 512 / WAVEFRONT_BYTES
            elif name.endswith("ptx_cp_async"):
                found["global"] = True
                nbytes = c.args[-1] if not isinstance(c.args[-1], tvm.ir.Call) else c.args[-2]
                lane = int(nbytes.value) if isinstance(nbytes, tirx.IntImm) else 4
                self.shared += trips * warps * lane / WIDEST_LANE_ACCESS
                self.requests += trips * warps
                self.sectors += trips * warps * math.ceil(32 * lane / SECTOR_BYTES)
            elif name.endswith("tvm_storage_sync") and c.args and str(c.args[0].value).startswith("shared"):
                self.barriers += trips

        tvm_ffi.structural_walk(e, [(tvm.ir.TensorLoad, load), (tvm.ir.Call, call)])
        return found["global"], found["shared"]

    # -- statements ----------------------------------------------------------------------------
    def stmt(self, s, trips: int, mask) -> None:
        warps = int(self._warps(mask).sum()) if self.threads else 1
        if warps == 0 or trips == 0:
            return
        if isinstance(s, tirx.SeqStmt):
            flat = _flat(s)      # nested sequences once, as one: their steps are counted here
            if not self.in_k_loop:
                self.k_steps += trips * _unrolled_steps(flat)
            for c in flat:
                self.stmt(c, trips, mask)
        elif isinstance(s, tirx.AttrStmt):
            if s.attr_key == "thread_extent":
                tag = str(s.node.thread_tag)
                self.extents[tag] = self._extent(s.value)
                if tag in _THREADS:
                    self.thread_vars.append((s.node.var, tag))
                    ids = self._thread_ids()
                    for var, t in self.thread_vars:
                        self.env[var] = ids[t]
                    mask = np.ones(self.threads, dtype=bool)
                else:
                    # a grid-stride trip is fewest at the last block, most at the first
                    self.env[s.node.var] = 0 if self.first_block else self.extents[tag] - 1
            self.stmt(s.body, trips, mask)
        elif isinstance(s, tirx.For):
            self._loop(s, trips, mask)
        elif isinstance(s, tirx.IfThenElse):
            try:
                taken = np.broadcast_to(np.asarray(self.eval(s.condition), dtype=bool), (self.threads,))
            except _Unknown:
                likely = isinstance(s.condition, tvm.ir.Call) and _op(s.condition).endswith("likely")
                taken = np.ones(self.threads, dtype=bool) if likely else None
            if taken is not None:
                self.stmt(s.then_case, trips, np.logical_and(mask, taken))
                if s.else_case is not None:
                    self.stmt(s.else_case, trips, np.logical_and(mask, ~taken))
        elif isinstance(s, (tirx.Bind, tirx.LetStmt)):
            try:
                self.env[s.var] = self.eval(s.value)
            except _Unknown:
                self.lets[s.var] = s.value
            self.expr(s.value, trips, warps, mask)
            if getattr(s, "body", None) is not None:
                self.stmt(s.body, trips, mask)
        elif isinstance(s, tirx.BufferStore):
            self.expr(s.value, trips, warps, mask)
            for i in s.indices:
                self.expr(i, trips, warps, mask)
            if _scope(s.buffer).startswith("shared"):
                self.shared += trips * warps * _lane_bytes(s.buffer, s.indices) / WIDEST_LANE_ACCESS
            elif _scope(s.buffer) == "global":
                self.global_access(s.buffer, s.indices, trips, mask)
        elif isinstance(s, tirx.Evaluate):
            self.expr(s.value, trips, warps, mask)
        elif isinstance(s, (tirx.AllocBuffer, tirx.DeclBuffer)):
            body = getattr(s, "body", None)
            if body is not None:
                self.stmt(body, trips, mask)
        elif isinstance(s, tirx.While):
            self.stmt(s.body, trips, mask)

    def _loop(self, loop, trips: int, mask) -> None:
        extent = self._extent(loop.extent) if loop.kind != tirx.ForKind.VECTORIZED else 1
        self.loop_vars.add(loop.loop_var)
        step = _Step(loop.body, loop.loop_var)
        counted = loop.kind in _STEPPED and extent > 1 and step.barrier and not step.inner
        if counted:
            if step.global_to_shared:
                self.k_steps += trips * extent
            else:
                self.pipelined += trips * extent
        self.in_k_loop += counted
        self.stmt(loop.body, trips * extent, mask)
        self.in_k_loop -= counted


_STEPPED = (tirx.ForKind.SERIAL, tirx.ForKind.UNROLLED)


def _flat(seq: tirx.SeqStmt) -> list:
    """The statements of ``seq`` with nested sequences spliced in."""
    out: list = []
    for c in seq.seq:
        out.extend(_flat(c) if isinstance(c, tirx.SeqStmt) else [c])
    return out


def _unrolled_steps(flat: list) -> int:
    """K steps of a K loop TVM unrolled into the statement sequence ``flat``: its
    store-then-barrier segments (a store of a global load in shared memory, then a barrier),
    where there are two or more; a statement holding a barrier of its own ends a segment."""
    segments, pending = 0, False
    for c in flat:
        step = _Step(c)
        if isinstance(c, tirx.Evaluate) and step.barrier:
            segments, pending = segments + pending, False
        elif step.barrier:
            pending = False
        elif step.global_to_shared:
            pending = True
    return segments if segments >= 2 else 0


class _Step:
    """What one iteration of a loop body holds: a shared barrier, a store of a global load straight
    into shared memory (an unpipelined K step), and whether an inner loop holds a barrier (then the
    inner loop is the step). With the loop's ``var``, only a load whose address moves with it
    streams: a loop-invariant one (a softmax's scale, ``s[0]``) is not waited for every iteration."""

    def __init__(self, body, var=None):
        self.barrier = self.global_to_shared = self.inner = False

        # what an iteration can move: the loop's variable and every one bound inside its body
        moving = [var]
        if var is not None:
            tvm_ffi.structural_walk(body, [(tirx.For, lambda f: moving.append(f.loop_var)),
                                           (tirx.Bind, lambda b: moving.append(b.var)),
                                           (tirx.LetStmt, lambda b: moving.append(b.var))])

        def streams(ld) -> bool:
            if var is None:
                return True
            found: list = []
            for i in ld.indices:
                tvm_ffi.structural_walk(i, (tirx.Var, lambda v: found.extend(m for m in moving if v.same_as(m))))
            return bool(found)

        def call(c):
            name = _op(c)
            if name.endswith("tvm_storage_sync") and c.args and str(c.args[0].value).startswith("shared"):
                self.barrier = True

        def store(s):
            if _scope(s.buffer).startswith("shared"):
                loads: list = []
                tvm_ffi.structural_walk(s.value, (tvm.ir.TensorLoad, lambda ld: loads.append(
                    _scope(ld.source) == "global" and streams(ld))))
                self.global_to_shared |= any(loads)

        def loop(f):
            inner: list = []
            tvm_ffi.structural_walk(f.body, (tvm.ir.Call, lambda c: inner.append(c)
                                             if _op(c).endswith("tvm_storage_sync") else None))
            self.inner |= bool(inner) and f.kind == tirx.ForKind.SERIAL and self._extent_gt1(f)

        tvm_ffi.structural_walk(body, [(tvm.ir.Call, call), (tirx.BufferStore, store), (tirx.For, loop)])

    @staticmethod
    def _extent_gt1(f) -> bool:
        return not (isinstance(f.extent, tirx.IntImm) and int(f.extent.value) <= 1)


def _walked(func: tirx.PrimFunc, first_block: bool) -> BlockCounts:
    walk = _Walk(first_block)
    walk.stmt(func.body, 1, np.ones(1, dtype=bool))
    return BlockCounts(max(walk.threads, 1), walk.shared, walk.k_steps, walk.pipelined, walk.barriers,
                       walk.requests, walk.sectors)


def block_counts(func: tirx.PrimFunc) -> BlockCounts:
    """What one block of the lowered device kernel ``func`` executes, at least: the last block
    (the least work), with what block 0 (the most) executes as ``busiest`` where that differs."""
    last, first = _walked(func, False), _walked(func, True)
    return last if first == last else dataclasses.replace(last, busiest=first)
