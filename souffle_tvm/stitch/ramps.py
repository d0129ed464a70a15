"""A wave kernel's ramps inside its loop: the first and last waves of a wavefront run as
iterations of the steady waves' loop, each stage under a guard on the wave, so the kernel's
code is one wave plus the cells that differ, not every wave written out.

``rolling.roll`` makes a loop of the longest run of identical iterations; in a wave kernel
(``waves``) those are the steady waves, where every layer has a cell. Wave w of a stack of L
layers and T steps holds the cells (l, w - l) with 0 <= w - l < T, so the L - 1 waves before
the steady ones and the L - 1 after hold fewer (DESIGN's guard ``wave < layer or wave >= steps
+ layer``). Here the waves (the segments between grid syncs) next to the loop join it while
some of their stages are a steady stage at that wave: the same code, its constants on the
steady stage's affine line, its tensors in the same slots of the same stacks. Such a stage is
*regular*: the loop's stage runs under a guard that holds at the waves where it is regular.
The others (a layer's first step, which reads the initial state; its last, which writes the
outputs; the first reader that fills a resident copy) are *variants*: each written once into
the loop body, in its place among the regular stages, under a guard that holds at its wave
alone. A guard is the stage loop's trip count (zero elsewhere), never an ``if``, and depends on
the wave alone: every thread of the grid reaches the same barriers, and TVM's ThreadSync may
place its own inside the stage. An iteration therefore runs exactly the statements its wave
ran, in their order, after one grid sync, with at least their barriers; ``rolling.unroll``
resolves the guards, so the static check and the emulator see every wave as it was.
"""

from __future__ import annotations

from typing import Callable, Hashable, NamedTuple

import tvm_ffi
from tvm import tirx

from .dependence import block_barrier
from .rolling import (MAX_PERIOD, MIN_TRIPS, ROLLED, Stack, Stage, Steady, affine, barrier_kind, finish, prepare,
                      restack, roll_range, steady, with_constants)
from ..te.rewrite import uses

_STRENGTH = {"": 0, "block": 1, "grid": 2}


class _Loop(NamedTuple):
    lo: int                  # the first stage the loop covers
    hi: int                  # one past the last
    stmt: tirx.For
    stacks: list[Stack]
    table: dict              # key Var -> (stack, slot) for the statements outside the loop


def roll(items: list[tuple], keys: list[list], writes: list[list[bool]], var_of: dict,
         stackable: Callable[[Hashable], bool], min_trips: int = MIN_TRIPS,
         max_period: int = MAX_PERIOD) -> tuple[list, list[Stack]]:
    """``rolling.roll`` for a wave kernel: its steady waves and the ramp waves beside them as
    ONE loop over the waves (same arguments, same result), the rest rolled as ``rolling`` does."""
    stages = prepare(items, keys, writes, var_of)
    loop = _wave_loop(stages, stackable, var_of, min_trips, max_period)
    if loop is None:
        out, stacks, table = roll_range(stages, 0, len(stages), stackable, var_of, min_trips, max_period)
        return finish(out, stacks, table, items)
    head, head_stacks, head_table = roll_range(stages, 0, loop.lo, stackable, var_of, min_trips, max_period)
    tail, tail_stacks, tail_table = roll_range(stages, loop.hi, len(stages), stackable, var_of, min_trips, max_period)
    return finish(head + [loop.stmt] + tail, head_stacks + loop.stacks + tail_stacks,
                  {**head_table, **loop.table, **tail_table}, items)


def _segments(stages: list[Stage]) -> list[tuple[int, int]]:
    """The waves: ``[start, end)`` of each run of stages from a grid sync to the next."""
    starts = [i for i, st in enumerate(stages) if barrier_kind(st.pre) == "grid"]
    return list(zip(starts, starts[1:] + [len(stages)]))


def _steady_waves(stages: list[Stage], segs: list[tuple[int, int]], min_trips: int,
                  max_period: int) -> tuple[int, int] | None:
    """The longest run of consecutive waves whose stages have the same skeletons, as
    ``(first wave, one past the last)``."""
    sig = [tuple(st.hash for st in stages[a:b]) for a, b in segs]
    best, k = None, 0
    while k < len(segs):
        m = k + 1
        while m < len(segs) and sig[m] == sig[k]:
            m += 1
        if (m - k >= min_trips and None not in sig[k] and len(sig[k]) <= max_period
                and (best is None or m - k > best[1] - best[0])):
            best = (k, m)
        k = m
    return best


def _wave_loop(stages: list[Stage], stackable, var_of: dict, min_trips: int, max_period: int) -> _Loop | None:
    segs = _segments(stages)
    found = _steady_waves(stages, segs, 2, max_period)    # two waves give the constants' steps
    if found is None:
        return None
    k0, k1 = found
    s, p = segs[k0][0], segs[k0][1] - segs[k0][0]
    run = steady(stages, s, p, k1 - k0, stackable)
    if run is None:
        return None
    na = k0 + run.a                   # the wave of the body's first iteration
    body = [stages[s + run.a * p + q] for q in range(p)]
    align = _Aligner(stages, segs, body, run, na)
    n0, n1 = na, k0 + run.b
    while n0 > 0 and any(q is not None for q in align(n0 - 1)):
        n0 -= 1
    while n1 < len(segs) and any(q is not None for q in align(n1)):
        n1 += 1
    if n1 - n0 < min_trips:
        return None
    lo, hi = segs[n0][0], segs[n1 - 1][1]
    inside = {k for st in stages[lo:hi] for k, w in zip(st.keys, st.writes) if w}
    slots = _Slots(body, run.rel, var_of, n0, lambda k: k in inside and stackable(k))
    regular: dict = {q: [] for q in range(p)}       # body stage -> the waves it is regular at
    variants: dict = {q: [] for q in range(p + 1)}  # body position -> [(wave, stage, first of its wave)]
    pres: dict = {q: barrier_kind(body[q].pre) if q else "" for q in range(p)}
    for n in range(n0, n1):
        a, b = segs[n]
        gap = 0
        for i, q in zip(range(a, b), align(n)):
            x = stages[i]
            if q is not None and slots.take(x, q, n):
                regular[q].append(n)
                if i > a and _STRENGTH[barrier_kind(x.pre)] > _STRENGTH[pres[q]]:
                    pres[q] = barrier_kind(x.pre)
                gap = q + 1
            else:
                variants[gap].append((n, x, i == a))
    t = tirx.Var("wave", "int64")
    stacks = slots.stacks(n1 - n0)
    entries: list = []
    for q in range(p + 1):
        for n, x, first in variants[q]:
            pre = [] if first or x.pre is None else [x.pre]
            entries += _guarded(pre + [x.stmt], [n], n0, n1, t)
        if q == p:
            break
        stmt = _regular_stmt(body[q], run, q, na, n0, t, var_of, stacks)
        if stmt is None:
            return None
        pre = [] if not pres[q] else [body[q].pre if barrier_kind(body[q].pre) == pres[q] else block_barrier()]
        entries += _guarded(pre + [stmt], regular[q], n0, n1, t)
    loop = tirx.For(t, tirx.const(0, "int64"), tirx.const(n1 - n0, "int64"), tirx.ForKind.SERIAL,
                    tirx.SeqStmt([body[0].pre] + entries), annotations={ROLLED: tirx.const(n1 - n0, "int64")})
    table = {var_of[k]: (stacks[site].var, tirx.const(m - n0, "int64")) for k, (site, m) in slots.where.items()}
    return _Loop(lo, hi, loop, list(stacks.values()), table)


class _Aligner:
    """Per wave, per stage: the body stage it is at that wave (same code, constants on the
    body stage's line), matched in order (a stage after the one matched before it), or None."""

    def __init__(self, stages: list[Stage], segs: list, body: list[Stage], run: Steady, na: int):
        self.stages, self.segs, self.body, self.run, self.na = stages, segs, body, run, na
        self.memo: dict = {}

    def __call__(self, n: int) -> list:
        if n not in self.memo:
            a, b = self.segs[n]
            out, q0 = [], 0
            for x in self.stages[a:b]:
                q = next((q for q in range(q0, len(self.body)) if self._is(x, q, n)), None)
                out.append(q)
                q0 = q0 if q is None else q + 1
            self.memo[n] = out
        return self.memo[n]

    def _is(self, x: Stage, q: int, n: int) -> bool:
        b = self.body[q]
        return (x.code is not None and x.code == b.code
                and x.consts == [c + d * (n - self.na) for c, d in zip(b.consts, self.run.step[q])]
                and tvm_ffi.structural_equal(x.skel, b.skel))


class _Slots:
    """Which tensor fills which slot of which stack. A stack per *site* (a body stage's
    parameter that writes a stacked tensor); its slot m holds the tensor written there at wave
    ``n0 + m``, by the regular stage or by a variant whose tensor a regular stage reads there."""

    def __init__(self, body: list[Stage], rel: list, var_of: dict, n0: int, stackable):
        self.body, self.rel, self.var_of, self.n0, self.stackable = body, rel, var_of, n0, stackable
        self.filled: dict = {}       # (site, wave) -> key
        self.where: dict = {}        # key -> (site, wave)

    def _proto(self, site) -> object:
        return self.var_of[self.body[site[0]].keys[site[1]]]

    def _fits(self, key, site) -> bool:
        a, b = self.var_of[key].ty, self._proto(site).ty
        return ([int(d) for d in a.shape] == [int(d) for d in b.shape] and str(a.dtype) == str(b.dtype)
                and str(a.storage_scope) == str(b.storage_scope))

    def take(self, x: Stage, q: int, n: int) -> bool:
        """Whether ``x`` is body stage ``q`` at wave ``n`` as far as its tensors go; if so, the
        slots it implies are taken."""
        new: dict = {}
        for k, r in zip(x.keys, self.rel[q]):
            if r[0] == "key":
                if k != r[1]:
                    return False
                continue
            site, m = (r[2], r[3]), n + r[1]
            cur = self.filled.get((site, m), new.get((site, m)))
            if cur is None:
                if (m < self.n0 or not self.stackable(k) or k in self.where or k in new.values()
                        or not self._fits(k, site)):
                    return False
                new[(site, m)] = k
            elif cur != k:
                return False
        for (site, m), k in new.items():
            self.filled[(site, m)] = k
            self.where[k] = (site, m)
        return True

    def stacks(self, trips: int) -> dict:
        out = {}
        for site in sorted({s for s, _ in self.filled}):
            proto = self._proto(site)
            var = tirx.decl_buffer([trips] + [int(d) for d in proto.ty.shape], str(proto.ty.dtype),
                                   f"{proto.name}_stack", scope=str(proto.ty.storage_scope) or "global")
            out[site] = Stack(var, [self.filled.get((site, self.n0 + m)) for m in range(trips)])
        return out


def _regular_stmt(b: Stage, run: Steady, q: int, na: int, n0: int, t: tirx.Var, var_of: dict,
                  stacks: dict) -> tirx.Stmt | None:
    """Body stage ``q`` at wave ``n0 + t``: its constants on their lines, its stacked tensors
    at their slots."""
    exprs = {i: affine(c + d * (n0 - na), d, t, dt)
             for i, (c, d, dt) in enumerate(zip(b.consts, run.step[q], b.dtypes)) if d != 0}
    stmt = with_constants(b.stmt, exprs) if exprs else b.stmt
    mine = {var_of[k]: (stacks[(r[2], r[3])].var, t + tirx.const(r[1], "int64"))
            for k, r in zip(b.keys, run.rel[q]) if r[0] == "slot"}
    out = restack(stmt, mine)
    return None if uses(out, list(mine)) else out


def _guarded(stmts: list, waves: list[int], n0: int, n1: int, t: tirx.Var) -> list:
    """``stmts`` (barriers, then one stage loop) with the stage loop's trip count zero outside
    ``waves`` (the loop variable ``t`` counts from wave ``n0``); unchanged where that is every
    wave of the loop. A trip count, not an ``if``: TVM's ThreadSync may place a block barrier
    in a stage but never under a condition, and the barriers before it run at every wave."""
    *pres, loop = stmts
    if list(waves) == list(range(n0, n1)):
        return stmts
    cond = None
    for u, v in _ranges(waves):
        lo, hi = tirx.const(u - n0, "int64"), tirx.const(v - n0, "int64")
        part = tirx.EQ(t, lo) if u == v else tirx.And(tirx.GE(t, lo), tirx.LE(t, hi))
        cond = part if cond is None else tirx.Or(cond, part)
    extent = tirx.Select(cond, loop.extent, tirx.const(0, str(loop.extent.ty)))
    return pres + [tirx.For(loop.loop_var, loop.min, extent, loop.kind, loop.body, annotations=loop.annotations)]


def _ranges(waves: list[int]) -> list[tuple[int, int]]:
    """``waves`` (ascending) as inclusive ranges of consecutive ones."""
    out: list = []
    for n in waves:
        if out and out[-1][1] == n - 1:
            out[-1] = (out[-1][0], n)
        else:
            out.append((n, n))
    return out
