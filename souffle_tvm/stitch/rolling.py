"""Loops for repeated stages: a run of stitched stages that repeats with a fixed period becomes
ONE loop in the kernel, so code size and compile time stop growing with it.

An LSTM's time steps are the same few stages again and again. They differ only in an integer
constant (the step's row of the input projection) and in which tensors they touch (step t reads
the h that step t-1 wrote). ``roll`` finds such runs among a stitched kernel's stages after the
stitcher has placed the barriers, so the loop keeps them. It checks that iteration n equals the
loop's first iteration a once

1. every integer constant that differs is affine in n (``c_a + step * (n - a)``), and
2. every tensor is either the same in all iterations, or made inside the run at a fixed
   distance in iterations. Such a tensor's copies, one per iteration, become the slots of ONE
   stacked buffer ``[iterations, *shape]``, which the loop indexes with its variable.

It then emits ``for t in range(b - a): body(a + t)``. The iterations that do not fit stay unrolled
around the loop: the first reads the initial state, and the last writes outputs that leave the
kernel. A tensor that is used after the kernel is never stacked.

``unroll`` is the inverse: the loop's body is written out once per iteration. The static check
and the emulator apply it, so they see exactly the statements the loop executes.
``repeats`` (its own module) is the same test at the level of a subprogram's groups.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Hashable, NamedTuple

import tvm
import tvm.sym as arith
import tvm_ffi
from tvm import s_tir, tirx

from .kernel_ir import is_grid_sync, replace_stages, stage_loops
from ..te.rewrite import uses

ROLLED = "souffle.rolled"        # annotation of a rolled loop: its trip count
MIN_TRIPS = 3                    # fewer iterations stay unrolled: a loop would not pay for itself
MAX_PERIOD = 64                  # stages per iteration, at most

_INDEX_DTYPES = ("int32", "int64")
_placeholders: dict = {}


def _placeholder(key, ty) -> tirx.Var:
    """One Var per (position, type), shared by all skeletons: equal skeletons are then equal
    without mapping free variables."""
    if key not in _placeholders:
        _placeholders[key] = tirx.Var(f"_roll{len(_placeholders)}", ty)
    return _placeholders[key]


def skeleton(node, params: dict | None = None) -> tuple[object, list[int], list[str]] | None:
    """``node`` with every integer constant (and every Var in ``params``, a map to a position)
    replaced by a placeholder, plus the constants in the order met and their dtypes. Two nodes with equal
    skeletons differ only in those constants (and those variables). None if TVM refuses the
    replacement somewhere (e.g. a vector's lane count must stay a constant)."""
    consts: list[int] = []
    dtypes: list[str] = []
    params = params or {}

    def const(c):
        if str(c.ty) not in _INDEX_DTYPES:
            return c
        consts.append(int(c.value))
        dtypes.append(str(c.ty))
        return _placeholder(("c", len(consts) - 1, str(c.ty)), str(c.ty))

    def var(v):
        j = params.get(v)
        return v if j is None else _placeholder(("p", j, tvm_ffi.structural_hash(v.ty)), v.ty)

    try:
        skel = tvm_ffi.structural_map(node, [(tirx.IntImm, const), (tirx.Var, var)])
    except Exception:       # noqa: BLE001 - any refusal means: not rollable
        return None
    return skel, consts, dtypes


@functools.lru_cache(maxsize=8192)
def skeleton_hash(node) -> int | None:
    """Cached: every stitch round (feedback, restitch) asks again for the same group PrimFuncs."""
    sk = skeleton(node)
    return None if sk is None else tvm_ffi.structural_hash(sk[0])


def with_constants(stmt, exprs: dict[int, tirx.PrimExpr]) -> tirx.Stmt:
    """``stmt`` with its k-th integer constant (in ``skeleton``'s order) replaced by ``exprs[k]``."""
    count = [-1]

    def const(c):
        if str(c.ty) not in _INDEX_DTYPES:
            return c
        count[0] += 1
        return exprs.get(count[0], c)

    return tvm_ffi.structural_map(stmt, (tirx.IntImm, const))


def restack(stmt, table: dict) -> tirx.Stmt:
    """Accesses to each buffer Var in ``table`` become accesses to its slot of a stacked buffer:
    ``table[var] = (stack, slot index)``; ``var[i, j]`` becomes ``stack[slot, i, j]``."""
    def load(x):
        hit = table.get(x.source)
        return x if hit is None else tirx.BufferLoad(hit[0], [hit[1]] + list(x.indices))

    def store(s):
        hit = table.get(s.buffer)
        return s if hit is None else tirx.BufferStore(hit[0], s.value, [hit[1]] + list(s.indices))

    return tvm_ffi.structural_map(stmt, [(tvm.ir.TensorLoad, load), (tirx.BufferStore, store)])


@dataclass
class Stack:
    """One stacked buffer: slot n holds the tensor ``keys[n]`` (None: a slot no key uses)."""
    var: tirx.Var
    keys: list


def stacked_keys(stacks: list[Stack]) -> set:
    """The keys the stacks replace (no longer parameters or outputs of their own)."""
    return {k for st in stacks for k in st.keys if k is not None}


@dataclass
class Stage:
    """One top-level item of a stitched kernel, as rolling compares them."""
    pre: tirx.Stmt | None        # the barrier before the stage, if any
    stmt: tirx.Stmt
    keys: list
    writes: list[bool]
    skel: object = None          # ``skeleton``: the code with its integer constants taken out
    consts: list | None = None
    dtypes: list | None = None
    code: int | None = None      # the skeleton's hash
    hash: int | None = None      # the same with the kind of barrier before it


def roll(items: list[tuple], keys: list[list], writes: list[list[bool]], var_of: dict,
         stackable: Callable[[Hashable], bool], min_trips: int = MIN_TRIPS,
         max_period: int = MAX_PERIOD) -> tuple[list, list[Stack]]:
    """The stitched kernel's top-level statements, repeated runs rolled into loops.

    ``items[i] = (barrier or None, stage loop)`` in kernel order; ``keys[i]`` and ``writes[i]``
    give, per parameter of stage i, the key of the tensor it binds and whether it writes it;
    ``var_of[key]`` is the kernel's buffer Var for a key. ``stackable(key)``: may that tensor
    become a slot of a stacked buffer (it is made in this kernel and not used after it)?

    Returns the statements and the stacked buffers (new kernel parameters; the keys they
    replace are no longer parameters).
    """
    stages = prepare(items, keys, writes, var_of)
    out, stacks, table = roll_range(stages, 0, len(stages), stackable, var_of, min_trips, max_period)
    return finish(out, stacks, table, items)


def prepare(items: list[tuple], keys: list[list], writes: list[list[bool]], var_of: dict) -> list[Stage]:
    """The items as ``Stage``s with their skeletons (None where TVM refuses one)."""
    stages = [Stage(pre, stmt, list(k), list(w)) for (pre, stmt), k, w in zip(items, keys, writes)]
    for st in stages:
        sk = skeleton(st.stmt, {var_of[k]: j for j, k in reversed(list(enumerate(st.keys)))})
        if sk is not None:
            st.skel, st.consts, st.dtypes = sk
            st.code = tvm_ffi.structural_hash(sk[0])
            st.hash = hash((barrier_kind(st.pre), st.code))
    return stages


def barrier_kind(pre) -> str:
    return "grid" if pre is not None and is_grid_sync(pre) else ("block" if pre is not None else "")


def roll_range(stages: list[Stage], lo: int, hi: int, stackable, var_of: dict, min_trips: int = MIN_TRIPS,
               max_period: int = MAX_PERIOD) -> tuple[list, list[Stack], dict]:
    """``stages[lo:hi]`` with repeated runs rolled: (the stages and loops in order, the stacks,
    {key Var: (stack, slot)} for the statements outside the loops)."""
    out: list = []
    stacks: list[Stack] = []
    table: dict = {}          # key Var -> (stack Var, slot) for statements outside loops
    i = lo
    while i < hi:
        run = _longest_run(stages, i, min_trips, max_period, hi)
        loop = _roll_run(stages, i, *run, stackable, var_of, min_trips) if run else None
        if loop is None:
            out.append(stages[i])
            i += 1
            continue
        (p, count), (before, body, after, run_stacks, run_table) = run, loop
        out += before + [body] + after
        stacks += run_stacks
        table.update(run_table)
        i += p * count
    return out, stacks, table


def finish(out: list, stacks: list[Stack], table: dict, items: list[tuple]) -> tuple[list, list[Stack]]:
    """The statements of ``out`` (stages and loops), the stages outside loops reaching stacked
    tensors at their slots; ``items`` unrolled where a stacked tensor is used other than by
    loads and stores."""
    seq = []
    for item in out:     # unrolled stages (and other runs' loops) reach stacked tensors at fixed slots
        if isinstance(item, Stage):
            if item.pre is not None:
                seq.append(item.pre)
            item = item.stmt
        seq.append(restack(item, table) if table else item)
    if table and uses(tirx.SeqStmt(seq), list(table)):
        # a stacked tensor still used other than by loads and stores: nothing is rolled
        plain = [x for pre, stmt in items for x in ((pre, stmt) if pre is not None else (stmt,))]
        return plain, []
    return seq, stacks


def _longest_run(stages: list[Stage], s: int, min_trips: int, max_period: int, n: int) -> tuple[int, int] | None:
    """(period, repetitions) of the longest run starting at stage ``s`` (ending by stage ``n``)
    whose stages' skeletons repeat (at least ``min_trips`` repetitions), or None."""
    if stages[s].hash is None:
        return None
    best = None
    for p in range(1, min(max_period, (n - s) // min_trips) + 1):
        if stages[s + p].hash != stages[s].hash:
            continue
        count = 1
        while s + (count + 1) * p <= n and all(stages[s + count * p + q].hash == stages[s + q].hash
                                               for q in range(p)):
            count += 1
        if count >= min_trips and (best is None or count * p > best[0] * best[1]):
            best = (p, count)
    return best


class Steady(NamedTuple):
    """The iterations ``[a, b)`` of a run that are one loop: per stage of the period, the
    constants' change per iteration (``step``), and per parameter, its tensor relative to the
    iteration (``rel``: ``("key", key)``, the same tensor in every iteration, or ``("slot",
    distance, stage, parameter)``, the tensor that stage's parameter wrote ``distance``
    iterations away); ``slot``: per stacked key, the (iteration, stage, parameter) that wrote it."""
    a: int
    b: int
    step: tuple
    rel: list[list[tuple]]
    slot: dict


def steady(stages: list[Stage], s: int, p: int, count: int, stackable) -> Steady | None:
    """The longest range of the run of ``count`` iterations of ``p`` stages at ``s`` in which each
    iteration is the one before with its constants moved by the same steps and its tensors in
    the same places relative to it; None if no two iterations are."""
    at = lambda it, q: stages[s + it * p + q]  # noqa: E731
    slot: dict = {}                  # key -> (iteration, stage, parameter) of its first write in the run
    for it in range(count):
        for q in range(p):
            st = at(it, q)
            for j, (k, w) in enumerate(zip(st.keys, st.writes)):
                if w and k not in slot and stackable(k):
                    slot[k] = (it, q, j)

    def rel(it):
        """Iteration ``it`` described relative to itself: equal descriptions, same code."""
        return [[("slot", slot[k][0] - it, slot[k][1], slot[k][2]) if k in slot else ("key", k)
                 for k in at(it, q).keys] for q in range(p)]

    def step(it):      # constant differences from iteration it-1 to it, per stage
        return tuple(tuple(c1 - c0 for c0, c1 in zip(at(it - 1, q).consts, at(it, q).consts)) for q in range(p))

    rels = [rel(it) for it in range(count)]
    best, a, cur_step = (0, 1, None), 0, None
    for it in range(1, count):
        same = rels[it] == rels[it - 1] and all(tvm_ffi.structural_equal(at(it, q).skel, at(it - 1, q).skel)
                                                for q in range(p))
        if same and (cur_step is None or step(it) == cur_step):
            cur_step = step(it) if cur_step is None else cur_step
        elif same:
            a, cur_step = it - 1, step(it)
        else:
            a, cur_step = it, None
        if it + 1 - a > best[1] - best[0]:
            best = (a, it + 1, cur_step)
    a, b, cur_step = best
    if b - a < 2:
        return None
    return Steady(a, b, cur_step, rels[a], slot)


def _roll_run(stages: list[Stage], s: int, p: int, count: int, stackable, var_of, min_trips: int):
    """The loop for the run of ``count`` iterations of ``p`` stages at ``s``: (stages before it,
    the loop, stages after it, its stacks, {key Var: (stack, slot)}), or None if no range of at
    least ``min_trips`` iterations matches (then the run stays unrolled)."""
    at = lambda it, q: stages[s + it * p + q]  # noqa: E731
    found = steady(stages, s, p, count, stackable)
    if found is None or found.b - found.a < min_trips:
        return None
    a, b, cur_step, slot = found.a, found.b, found.step, found.slot
    # Stacks: one per (stage, parameter) that first writes stackable tensors in this run.
    by_site: dict = {}
    for k, (it, q, j) in slot.items():
        by_site.setdefault((q, j), {})[it] = k
    stacks, slot_table = [], {}      # key -> (stack, slot)
    for (q, j), per_it in by_site.items():
        proto = var_of[next(iter(per_it.values()))]
        shape = [count] + [int(d) for d in proto.ty.shape]
        if any([int(d) for d in var_of[k].ty.shape] != shape[1:] or str(var_of[k].ty.dtype) != str(proto.ty.dtype)
               for k in per_it.values()):
            return None
        var = tirx.decl_buffer(shape, str(proto.ty.dtype), f"{proto.name}_stack", scope=str(proto.ty.storage_scope) or "global")
        stacks.append(Stack(var, [per_it.get(it) for it in range(count)]))
        slot_table.update({k: (var, it) for it, k in per_it.items()})
    t = tirx.Var("step", "int64")
    body = []
    for q in range(p):
        st = at(a, q)
        varying = {k: c for k, c in enumerate(cur_step[q]) if c != 0}
        exprs = {k: affine(st.consts[k], d, t, st.dtypes[k]) for k, d in varying.items()}
        stmt = with_constants(st.stmt, exprs) if exprs else st.stmt
        mine = {var_of[k]: (slot_table[k][0], t + tirx.const(slot_table[k][1], "int64"))
                for k in st.keys if k in slot_table}
        # every key Var of this stage that is stacked is one of the run's slots a + t + distance
        stmt = restack(stmt, mine)
        if uses(stmt, list(mine)):
            return None          # used other than by loads and stores (an access pointer): keep unrolled
        if st.pre is not None:
            body.append(st.pre)
        body.append(stmt)
    loop = tirx.For(t, tirx.const(0, "int64"), tirx.const(b - a, "int64"), tirx.ForKind.SERIAL,
                    tirx.SeqStmt(body) if len(body) > 1 else body[0],
                    annotations={ROLLED: tirx.const(b - a, "int64")})
    before = [at(it, q) for it in range(a) for q in range(p)]
    after = [at(it, q) for it in range(b, count) for q in range(p)]
    table = {var_of[k]: (var, tirx.const(it, "int64")) for k, (var, it) in slot_table.items()}
    return before, loop, after, stacks, table


def affine(c0: int, step: int, t: tirx.Var, dtype: str) -> tirx.PrimExpr:
    e = tirx.const(c0, "int64") + tirx.const(step, "int64") * t
    return e if dtype == "int64" else tirx.Cast(dtype, e)


def unroll(func: tirx.PrimFunc, fresh: bool = False) -> tirx.PrimFunc:
    """``func`` with each rolled loop written out, one copy of its body per iteration (``fresh``:
    each copy with its own loop and buffer definitions, as TVM's lowering requires). A stage
    under a guard on the iteration (``ramps``) is written out where the guard holds, without it,
    and left out where it does not."""
    seq = stage_loops(func)
    ana = arith.Analyzer()
    if not any(isinstance(s, tirx.For) and ROLLED in s.annotations for s in seq):
        return func
    out = []
    for stmt in seq:
        if not (isinstance(stmt, tirx.For) and ROLLED in stmt.annotations):
            out.append(stmt)
            continue
        for it in range(int(stmt.extent)):
            value = tirx.const(it, str(stmt.loop_var.ty))
            copy = tvm_ffi.structural_map(stmt.body, (tirx.Var, lambda v: value if v.same_as(stmt.loop_var) else v))
            if fresh:
                copy = s_tir.renew_defs(tirx.PrimFunc([], copy)).body
            out += _resolved(list(copy.seq) if isinstance(copy, tirx.SeqStmt) else [copy], ana)
    return replace_stages(func, out)


def _resolved(seq: list, ana) -> list:
    """``seq`` with each guard resolved (``ramps``: a stage loop whose trip count is zero but at
    some iterations, now a constant condition): the loop as it runs there, or nothing."""
    out = []
    for stmt in seq:
        ext = stmt.extent if isinstance(stmt, tirx.For) else None
        cond = ana.simplify(ext.condition) if isinstance(ext, tirx.Select) else None
        if not isinstance(cond, tirx.IntImm):
            out.append(stmt)
        elif cond.value:
            out.append(tirx.For(stmt.loop_var, stmt.min, ext.true_value, stmt.kind, stmt.body,
                                annotations=stmt.annotations))
    return out


def unstack(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` (unrolled) with each buffer whose every access names a constant slot (first index)
    split into one buffer per slot, for checks that reason per buffer: slots are disjoint
    memory, so a stack's slots stand apart the way the tensors rolling stacked did (step t+1's h
    is written while the blocks of step t may still read step t's). A parameter's slots become
    parameters, an allocation's slots allocations."""
    seen: dict = {}          # buffer -> its slots, or None once an access is not constant
    ana = arith.Analyzer()

    def slot(indices) -> int | None:
        first = ana.simplify(indices[0]) if len(indices) > 1 else None
        return int(first.value) if isinstance(first, tirx.IntImm) else None

    def note(buf, indices):
        k = slot(indices)
        ok = k is not None and seen.get(buf, ()) is not None
        seen[buf] = (seen.get(buf) or set()) | {k} if ok else None

    tvm_ffi.structural_walk(func.body, [(tvm.ir.TensorLoad, lambda x: note(x.source, list(x.indices))),
                                        (tirx.BufferStore, lambda x: note(x.buffer, list(x.indices)))])
    kernel_wide = list(func.params) + [st.buffer for st in stage_loops(func) if isinstance(st, tirx.AllocBuffer)]
    slots = {b: {k: tirx.decl_buffer(list(b.ty.shape)[1:], str(b.ty.dtype), f"{b.name}_{k}",
                                     scope=str(b.ty.storage_scope) or "global") for k in sorted(ks)}
             for b, ks in seen.items() if ks and any(b.same_as(x) for x in kernel_wide)}
    if not slots:
        return func

    def load(x):
        hit = slots.get(x.source)
        return x if hit is None else tirx.BufferLoad(hit[slot(list(x.indices))], list(x.indices)[1:])

    def store(x):
        hit = slots.get(x.buffer)
        return x if hit is None else tirx.BufferStore(hit[slot(list(x.indices))], x.value, list(x.indices)[1:])

    seq = []
    for stmt in stage_loops(func):
        if isinstance(stmt, tirx.AllocBuffer) and stmt.buffer in slots:
            seq += [tirx.AllocBuffer(b) for b in slots[stmt.buffer].values()]
        else:
            seq.append(tvm_ffi.structural_map(stmt, [(tvm.ir.TensorLoad, load), (tirx.BufferStore, store)]))
    out = replace_stages(func, seq)
    if uses(out.body, list(slots)):       # reached other than by loads and stores: left whole
        return func
    params = [b for p in func.params for b in (slots[p].values() if p in slots else [p])]
    return tirx.PrimFunc(params, out.body, attrs=func.attrs)
