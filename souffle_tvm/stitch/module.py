"""Stitching in a Relax module: each subprogram's ``call_tir`` bindings become ONE call of a
stitched kernel (``kernel.stitch``), checked safe (``check``) before it is emitted.

V4's L2 prefetch is a separate step on the result (``prefetch.plant_module``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import tvm
import tvm_ffi
from tvm import relax

from . import lower, resident, rolling
from .check import SafetyReport, check
from .kernel import onchip_key, stitch, written_out
from ..codegen.emit import is_group_call
from ..cost import tir_stats
from ..core.geometry import STITCH_BLOCK
from ..errors import StitchError


class StageId(NamedTuple):
    """Where a stage of a stitched kernel came from: the stage PrimFunc (``function``) and,
    when it lowered to several launch regions, which one (``region``; None when just one)."""
    function: str
    region: int | None


@dataclass
class StitchedKernel:
    name: str                      # souffle_stitched_<index>
    index: int                     # the subprogram it was made from
    stages: list[str]
    grid_syncs: int
    grid: int
    safety: SafetyReport | None = None
    max_blocks: int = 0            # the most blocks any stage has: more grid would idle
    function: str = ""             # the PrimFunc it calls: identical kernels (repeated layers) share one
    prefetched_bytes: int = 0      # V4: bytes of inputs prefetched into L2 ahead of the segment reading them
    stage_ids: list[StageId] = field(default_factory=list)   # per entry of ``stages``: its PrimFunc and region
    geometry: list[tuple[int, int]] = field(default_factory=list)   # per stage: (tiles, threads) as its own kernel
    min_blocks: int | None = None  # register cap: nvcc leaves room for this many blocks per SM
    block: int = STITCH_BLOCK      # threads per block (``partition.block_choice``)
    # stage PrimFunc name -> its schedule at ``block``, where that is not the module's (``STITCH_BLOCK``) one
    stage_funcs: dict = field(default_factory=dict)
    block_reason: str | None = None   # why ``block`` is not ``STITCH_BLOCK``
    # per entry of ``stages``: the positions of its parameters kept on chip (``channel``)
    onchip: list[list[int]] = field(default_factory=list)
    onchip_bytes: int = 0          # per block: the shared memory those channels take
    resident_bytes: int = 0        # per block: the shared memory its inputs' copies take (``resident``)
    resident_inputs: list[str] = field(default_factory=list)   # the inputs copied, by name
    filled: list[dict] = field(default_factory=list)   # per entry of ``stages``: {position: bytes its fills read}
    # per entry of ``stages``: what one block of its tiles executes, counted with the stage stitched
    # alone at ``block`` (the partitioner's figures: {"tiles", "sectors", "k_steps",
    # "shared_wavefronts"}), None where not counted; set by the pass that stitches
    counted_alone: list = field(default_factory=list)
    # per entry of ``stages``: (segment between grid syncs, lane); a segment's lanes run at once (``waves``)
    phases: list[tuple[int, int]] = field(default_factory=list)
    written_out: int = 0           # stage loops its body writes out (a rolled loop's body once: ``kernel.written_out``)


    def stage_func(self, function: str, funcs: dict):
        """Stage PrimFunc ``function`` as this kernel runs it: its schedule at ``block`` where
        that is not the module's, else ``funcs[function]`` (None where neither has it)."""
        return self.stage_funcs.get(function, funcs.get(function))


def function_runs(stage_ids: list[StageId]) -> list[list[int]]:
    """Consecutive stage entries of one call of a function (its launch regions, in order)."""
    runs: list[list[int]] = []
    for i, sid in enumerate(stage_ids):
        if runs and stage_ids[runs[-1][-1]].function == sid.function and (sid.region or 0) > 0:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def kernel_name(subprogram: int) -> str:
    """The name of the stitched kernel made from subprogram ``subprogram`` (and its Relax call)."""
    return f"souffle_stitched_{subprogram}"


class ExprKey:
    """A Relax expression as a dict key (identity; Relax overloads nothing, but be explicit)."""

    def __init__(self, expr):
        self.expr = expr

    def __hash__(self):
        return hash(self.expr)

    def __eq__(self, other):
        return isinstance(other, ExprKey) and self.expr.same_as(other.expr)


class Produced(NamedTuple):
    """A tensor a stitched call makes, as a key: field ``index`` of the ``pos``-th call it
    replaces ("out"), that call's scratch buffer ``index`` ("scratch"), or stacked buffer
    ``index`` of the kernel ("stack", ``pos`` unused). Inputs are keyed by ``ExprKey``."""
    kind: str
    pos: int
    index: int


def stitch_module(mod: tvm.IRModule, target: tvm.target.Target, subprograms: list[list[int]], grid: int,
                  block: int = STITCH_BLOCK,
                  grids: dict[str, int] | None = None,
                  min_blocks: dict[str, int] | None = None,
                  blocks: dict[str, tuple[int, dict]] | None = None,
                  onchip: bool = True) -> tuple[tvm.IRModule, list[StitchedKernel]]:
    """Replace each subprogram's consecutive ``call_tir`` bindings of ``main`` by ONE call.

    ``subprograms`` lists, per subprogram, the positions of its calls among main's call_tir
    bindings. The stage PrimFuncs must be scheduled with ``block`` threads. An intermediate
    proven block-local and read nowhere after the kernel stays on chip (``onchip``: the
    channel, ``channel``); the others become extra outputs of the stitched call (global
    buffers the VM allocates).

    Each kernel launches ``grids.get(name, grid)`` blocks, capped at the most blocks any of its
    stages has (more would idle at every grid sync). The co-resident limit is left to the
    build, which has ptxas' figures. ``min_blocks``: kernel name -> its register cap (blocks
    per SM nvcc must leave room for). ``blocks``: kernel name -> (its threads per block, its stage
    PrimFuncs scheduled at that size by name) where it is not ``block`` (``partition.block_choice``).
    Identical kernels (repeated layers) share one PrimFunc.
    """
    blocks = blocks or {}
    main = mod["main"]
    bindings = [b for blk in main.body.blocks for b in blk.bindings]
    call_pos = [i for i, b in enumerate(bindings) if is_group_call(b.value)]
    member_of = {}
    for k, sp in enumerate(subprograms):
        if len(sp) > 1:
            for j in sp:
                member_of[call_pos[j]] = k
    kernels: list[StitchedKernel] = []
    # The partitioner draws every boundary: it never hands over a stage that cannot be stitched
    # (it asks ``lower.why_not_stitchable`` too); one here is a bug upstream, not a new cut.
    for k, sp in enumerate(subprograms):
        size, funcs = blocks.get(kernel_name(k), (block, {}))
        for j in (sp if len(sp) > 1 else []):
            gv = bindings[call_pos[j]].value.args[0]
            why = lower.why_not_stitchable(funcs.get(gv.name_hint, mod[gv]), target, size)
            if why is not None:
                raise StitchError(f"subprogram {k} holds a stage that cannot be stitched: {why}")
    stitched_calls = [bindings[call_pos[j]] for sp in subprograms if len(sp) > 1 for j in sp]
    stitched_vars = {b.var for b in stitched_calls}
    stitched_aliases = _aliases(bindings, stitched_calls)
    alias_positions = {i for i, b in enumerate(bindings) if b.var in stitched_aliases and b.var not in stitched_vars}
    uses = _use_counts(bindings, main.body.body)
    ctx = tvm.IRModule({gv: f for gv, f in mod.functions.items() if gv.name_hint != "main"})
    bb = relax.BlockBuilder(ctx)
    with bb.function("main", list(main.params), attrs={k: v for k, v in main.attrs.items() if k != "global_symbol"}):
        with bb.dataflow():
            env: dict = {}
            done = set()
            for i, b in enumerate(bindings):
                if i in member_of:
                    k = member_of[i]
                    if k not in done:
                        done.add(k)
                        calls = [bindings[call_pos[j]] for j in subprograms[k]]
                        name = kernel_name(k)
                        aliases = _aliases(bindings, calls)
                        mine = {b.var for b in calls} | set(aliases)
                        inside = _use_counts([b for b in bindings if b.var in mine])
                        used_after = {v for v, n in uses.items() if n > inside.get(v, 0)}
                        size, funcs = blocks.get(name, (block, {}))
                        kernels.append(_emit_stitched(bb, mod, target, calls, aliases, env,
                                                      (grids or {}).get(name, grid), size, k, used_after,
                                                      (min_blocks or {}).get(name), funcs, onchip))
                    continue
                if i in alias_positions:      # a field of a stitched call: already bound by the stitch
                    continue
                env[b.var] = bb.emit(_remap(b.value, env))
            out = bb.emit_output(_remap(main.body.body, env))
        bb.emit_func_output(out)
    return bb.get(), kernels


def _use_counts(bindings, output=None) -> dict:
    """How often each Relax Var is used by ``bindings`` (and ``output``)."""
    counts: dict = {}

    def count(v):
        counts[v] = counts.get(v, 0) + 1

    for node in [b.value for b in bindings] + ([output] if output is not None else []):
        tvm_ffi.structural_walk(node, (relax.Var, count))
    return counts


def _remap(expr, env):
    if isinstance(expr, relax.Var):
        return env.get(expr, expr)
    return tvm_ffi.structural_map(expr, (relax.Var, lambda v: env.get(v, v)))


def _aliases(bindings, calls) -> dict:
    """``v = t[i]`` bindings whose ``t`` is one of ``calls``: v stands for field i of call t."""
    pos = {}
    out = {}
    for p, b in enumerate(calls):
        pos[b.var] = p
        if not isinstance(b.var.ty, relax.TupleType):
            out[b.var] = Produced("out", p, 0)    # a single-output call stands for its only field
    for b in bindings:
        if isinstance(b.value, relax.TupleGetItem) and b.value.tuple_value in pos:
            out[b.var] = Produced("out", pos[b.value.tuple_value], b.value.index)
    return out


def _emit_stitched(bb, mod, target, calls, aliases, env, grid, block, index, used_after=None,
                   min_blocks=None, stage_funcs=None, onchip=True) -> StitchedKernel:
    """Stitch ``calls`` (subprogram ``index``) into one kernel, check it, and emit its call.
    ``stage_funcs``: stage PrimFuncs by name, scheduled at ``block``, in place of ``mod``'s."""
    stage_funcs = stage_funcs or {}
    name = kernel_name(index)
    # Keys: a produced tensor is a Produced; an input is its Relax expression (an ExprKey).
    produced, types = [], []
    stages, args, ids = [], [], []
    for pos, b in enumerate(calls):
        gv, fargs = b.value.args[0], list(b.value.args[1].fields)
        fields = list(b.var.ty.fields) if isinstance(b.var.ty, relax.TupleType) else [b.var.ty]
        outs = [Produced("out", pos, i) for i in range(len(fields))]
        produced += outs
        types += fields
        ins = [aliases.get(a, a) if isinstance(a, relax.Var) else a for a in fargs]
        lowered = lower.lower_stage(gv.name_hint, stage_funcs.get(gv.name_hint, mod[gv]), target)
        n_scratch = lowered[0].scratch
        scratch = [Produced("scratch", pos, i) for i in range(n_scratch)]
        produced += scratch
        for buf in lowered[0].params[len(lowered[0].params) - n_scratch:]:
            types.append(relax.TensorType([int(d) for d in buf.ty.shape], str(buf.ty.dtype)))
        for region, st in enumerate(lowered):
            stages.append(st)
            args.append(ins + outs + scratch)
            ids.append(StageId(gv.name_hint, region if len(lowered) > 1 else None))
    inputs = []
    for a in (x for fa in args for x in fa if not isinstance(x, Produced)):
        if not any(a.same_as(x) for x in inputs):
            inputs.append(a)
    keys = [ExprKey(x) for x in inputs] + produced
    grid = max(1, min(grid, max(st.num_blocks for st in stages)))
    # A tensor may become a slot of a stacked buffer (a loop's per-iteration copy) unless
    # something after the kernel reads it: a scratch buffer, or an output nobody else uses.
    leaves = set()
    for pos, b in enumerate(calls):
        if used_after is None or b.var in used_after:
            leaves.update(k for k in produced if k.kind == "out" and k.pos == pos)
    leaves.update(key for alias, key in aliases.items() if used_after is None or alias in used_after)
    private = lambda k: isinstance(k, Produced) and k not in leaves  # noqa: E731 - made here, read nowhere after
    func, syncs, stacks, channels, order, residents, onchip_stacks, phases = stitch(
        stages, [[x if isinstance(x, Produced) else ExprKey(x) for x in fa] for fa in args], grid, block, name=name,
        target=target, param_keys=keys, stackable=private, min_blocks=min_blocks,
        private=private if onchip else None)
    onchip_keys = {ch.key for ch in channels if not ch.dual}
    if onchip_keys:         # no longer outputs of the call: they never leave the chip
        kept = [(k, t) for k, t in zip(produced, types) if k not in onchip_keys]
        produced, types = [k for k, _ in kept], [t for _, t in kept]
    if stacks:
        kind = dict(zip(produced, types))
        stacked = rolling.stacked_keys(stacks)
        produced = [k for k in produced if k not in stacked] + [Produced("stack", -1, m) for m in range(len(stacks))]
        types = [kind[k] for k in produced[:len(produced) - len(stacks)]] + \
                [relax.TensorType([int(d) for d in st.var.ty.shape], str(st.var.ty.dtype)) for st in stacks]
    safety = check(func, grid, None)
    if not safety.ok and onchip and channels and any("_onchip" in p for p in safety.problems):
        # A safety net: the channel plan proves each channel on the stage views before stitching,
        # the check on the kernel stitched (rolled, barriers in place). Where the two disagree (as
        # a stage's leading barrier once made them: issue 58, item 2), the kernel keeps its
        # tensors in global memory behind the grid syncs the dependences need, instead of failing.
        return _emit_stitched(bb, mod, target, calls, aliases, env, grid, block, index, used_after, min_blocks,
                              stage_funcs, onchip=False)
    if not safety.ok:
        raise StitchError(f"{name}: unsafe stitched kernel: {'; '.join(safety.problems)}")
    gv = bb.add_func(func.without_attr("global_symbol"), name)
    sinfo = [relax.TensorType([int(d) for d in t.shape], t.dtype) for t in types]
    call = bb.emit(relax.call_tir(gv, [_remap(a, env) for a in inputs], sinfo))
    # one output left (the rest stay on chip): call_tir gives that tensor itself, not a tuple of it
    items = {key: call if len(sinfo) == 1 else bb.emit(relax.TupleGetItem(call, i))
             for i, key in enumerate(produced) if key.kind == "out"}
    for pos, b in enumerate(calls):
        n_out = len(b.var.ty.fields) if isinstance(b.var.ty, relax.TupleType) else 1
        outs = [items[k] for k in produced if k.kind == "out" and k.pos == pos]
        if len(outs) == n_out:        # (a stacked output is used nowhere after the kernel)
            env[b.var] = outs[0] if not isinstance(b.var.ty, relax.TupleType) else bb.emit(relax.Tuple(outs))
        for alias, key in aliases.items():
            if key.pos == pos and key in items:
                env[alias] = items[key]
    return StitchedKernel(name, index, [s.name for s in stages], sum(syncs), grid, safety,
                          max_blocks=max(st.num_blocks for st in stages), function=gv.name_hint, stage_ids=ids,
                          geometry=[(st.num_blocks, st.num_threads) for st in stages], min_blocks=min_blocks,
                          block=block, stage_funcs={ident.function: stage_funcs[ident.function] for ident in ids
                                                    if ident.function in stage_funcs},
                          onchip=_onchip_positions(channels, residents, order, args),
                          onchip_bytes=_onchip_bytes(channels, onchip_stacks),
                          resident_bytes=sum(tir_stats.buffer_bytes(b) for b in resident.copies(residents)),
                          resident_inputs=[r.name for r in residents], filled=_filled(residents, order, args),
                          phases=[phases[p] for p in sorted(range(len(order)), key=order.__getitem__)],
                          written_out=written_out(func))


def _onchip_bytes(channels: list, onchip_stacks: list) -> int:
    """The shared memory a block's channels take: a stacked channel's stack counted once."""
    stacked = rolling.stacked_keys(onchip_stacks)
    return sum(ch.bytes for ch in channels if onchip_key(ch) not in stacked) + \
        sum(tir_stats.buffer_bytes(st.var) for st in onchip_stacks)


def _filled(residents: list, order: list[int], args: list[list]) -> list[dict[int, int]]:
    """Per stage (in ``args``' order): {parameter position: the bytes its fills read} where it is
    a resident input's first reader (its fill may read more of the input than the stage would)."""
    out: list[dict[int, int]] = [{} for _ in args]
    for r in residents:
        stage = order[r.readers[0]]
        out[stage].update((j, r.filled_bytes) for j in _positions(args[stage], r.key))
    return out


def _positions(args: list, key) -> list[int]:
    """The positions of a stage's arguments (a Produced key or an input's Relax expression) that are ``key``."""
    return [j for j, x in enumerate(args) if (x if isinstance(x, Produced) else ExprKey(x)) == key]


def _onchip_positions(channels: list, residents: list, order: list[int], args: list[list]) -> list[list[int]]:
    """Per stage (in ``args``' order), the positions of the parameters whose global traffic it no
    longer makes: a channel's readers, and its writer unless the tensor is written out too; a
    resident input's readers after the first (which fills the copy)."""
    out: list[list[int]] = [[] for _ in args]
    for key, stages in [(ch.key, ch.readers + ([] if ch.dual else [ch.writer])) for ch in channels] + \
            [(r.key, r.readers[1:]) for r in residents]:
        for i in stages:
            stage = order[i]
            out[stage] += _positions(args[stage], key)
    return [sorted(set(p)) for p in out]
