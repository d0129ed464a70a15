"""TEProgram + Partition → a Relax module: one PrimFunc per group, called from ``main``.

Each group's members are rebuilt over placeholders for what they read from outside the
group, so ``te.create_prim_func`` makes exactly the group's blocks. Group PrimFuncs are marked
opaque to FuseOps (``op_pattern`` = kOpaque) so TVM's fuser never redraws our boundaries;
opaque Relax ops are emitted as they were and go through TVM's default path.

A reduction that reads one outside tensor at two different indices (attention's ``Q K^T``, both
operands sliced out of one fused QKV projection by composed index maps) reads it through two
parameters, both passed the same tensor: the GEMM schedule rules (dlight's ``Matmul`` and
ours) find a contraction only over operands in distinct buffers, and would otherwise leave it
to ``Fallback``, one output per thread and no operand reuse.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax, te

from ..core.ir_names import GROUP_PREFIX, K_OPAQUE
from ..core.root_block import require_root_blocks
from ..te import rewrite as te_rewrite
from ..partition.groups import Group, Partition, group_outputs
from ..te.program import TEProgram



def group_primfunc(group: Group, outputs: list[te.Tensor]) -> tuple[tvm.tirx.PrimFunc, list[te.Tensor]]:
    """The group as one PrimFunc; returns it and the external tensors its params stand for."""
    members = {m.op for m in group.members}
    externals: list[te.Tensor] = []
    ext_ph: dict = {}
    new_of: dict = {}

    # in a reduction: (op, value_index) -> the index lists it read that tensor at (else None)
    patterns: dict | None = None

    def load_fn(tensor, idx):
        if tensor.op in new_of:
            return new_of[tensor.op][tensor.value_index](*idx)
        if tensor.op in members:
            raise AssertionError("members are rebuilt in topological order")
        key = (tensor.op, tensor.value_index, _operand(patterns, tensor, idx))
        if key not in ext_ph:
            externals.append(tensor)
            name = tensor.op.name + (f"_operand{key[2]}" if key[2] else "")
            ext_ph[key] = te.placeholder(tensor.shape, tensor.dtype, name=name)
        return ext_ph[key](*idx)

    for m in group.members:
        if m.op not in new_of:
            patterns = {} if m.op.reduce_axis else None
            new_of[m.op] = te_rewrite.rebuild(m.op, load_fn)
    outs = [new_of[o.op][o.value_index] for o in outputs]
    params = list(ext_ph.values())      # in the order of ``externals``
    func = te.create_prim_func(params + outs)
    # create_prim_func names every function "main"; the Relax module gives it a symbol later.
    func = func.without_attr("global_symbol").with_attr("op_pattern", K_OPAQUE)
    return func, externals


class GroupFuncs:
    """``group_primfunc`` once per (members, outputs): the partitioner's schedule checks and both
    of a partition's emits (scheduled and not) ask for the same groups."""

    def __init__(self):
        self._made: dict = {}

    def __call__(self, group: Group, outputs: list[te.Tensor]) -> tuple[tvm.tirx.PrimFunc, list[te.Tensor]]:
        key = (tuple(m.op for m in group.members), tuple((o.op, o.value_index) for o in outputs))
        if key not in self._made:
            self._made[key] = group_primfunc(group, outputs)
        func, externals = self._made[key]
        return func, list(externals)


def _same_indices(a: list, b: list) -> bool:
    """Whether two index lists are the same expressions. An index that loads a tensor (a Gather's
    data-dependent index) holds a TE producer, which TVM's structural equality refuses: those
    are the same only as the same objects. Two patterns kept apart by mistake only give two
    parameters to one tensor's reads; it never changes what is read."""
    try:
        return tvm_ffi.structural_equal(list(a), list(b))
    except TypeError:
        return len(a) == len(b) and all(x.same_as(y) for x, y in zip(a, b))


def _operand(patterns: dict | None, tensor: te.Tensor, idx: list) -> int:
    """0, or in a reduction (``patterns`` not None) the number of the distinct index pattern
    ``tensor`` is read at."""
    if patterns is None:
        return 0
    seen = patterns.setdefault((tensor.op, tensor.value_index), [])
    for i, other in enumerate(seen):
        if _same_indices(other, idx):
            return i
    seen.append(list(idx))
    return len(seen) - 1


def emit_module(prog: TEProgram, part: Partition, schedule=None, funcs: GroupFuncs | None = None) -> tvm.IRModule:
    """``main(inputs..., weights...)`` calling one PrimFunc per group, in the partition's order.

    The parameters are the program's inputs then its weights (``prog.weight_arrays()`` order).
    ``schedule(func) -> func`` schedules each group PrimFunc (identity when None); ``funcs``:
    the group PrimFuncs already made (default: made here).
    """
    make = funcs or group_primfunc
    placeholders = list(prog.inputs) + list(prog.weights)
    params = [relax.Var(t.op.name, relax.TensorType([int(d) for d in t.shape], str(t.dtype))) for t in placeholders]
    num_input = len(prog.inputs)
    outputs_of = group_outputs(prog, part.groups)

    bb = relax.BlockBuilder()
    with bb.function("main", params, attrs={"num_input": num_input}):
        with bb.dataflow():
            env: dict = {}
            for t, p in zip(placeholders, params):
                env[(t.op, t.value_index)] = p
            for t, value in prog.constants.items():
                env[(t.op, t.value_index)] = relax.const(value, str(t.dtype))
            for g in part.groups:
                if g.opaque is not None:
                    _emit_opaque(bb, g, env)
                    continue
                outs = outputs_of[id(g)]
                func, externals = make(g, outs)
                if schedule is not None:
                    func = schedule(func)
                gv = bb.add_func(func, f"{GROUP_PREFIX}{g.name}")
                args = [env[(x.op, x.value_index)] for x in externals]
                sinfo = [relax.TensorType([int(d) for d in o.shape], str(o.dtype)) for o in outs]
                call = relax.call_tir(gv, args, sinfo if len(sinfo) > 1 else sinfo[0])
                value = bb.emit(call)
                for i, o in enumerate(outs):
                    env[(o.op, o.value_index)] = value if len(outs) == 1 else bb.emit(relax.TupleGetItem(value, i))
            result = [env[(t.op, t.value_index)] for t in prog.outputs]
            out = bb.emit_output(result[0] if len(result) == 1 else relax.Tuple(result))
        bb.emit_func_output(out)
    # group PrimFuncs come from create_prim_func and opaque callees from Relax's legalization:
    # both under a root block, which TVM's Relax passes require; checked here, where they are emitted
    return require_root_blocks(bb.get(), "codegen.emit")


def _emit_opaque(bb: relax.BlockBuilder, g: Group, env: dict) -> None:
    o = g.opaque
    remap = {v: env[(t.op, t.value_index)] for v, t in o.inputs.items()}
    # functions the call names (call_tir's PrimFunc) come along into the new module
    # (never under a group's name: ``is_group_call`` tells the two apart by it)
    remap.update({gv: bb.add_func(o.callees[gv.name_hint], gv.name_hint if not gv.name_hint.startswith(GROUP_PREFIX)
                                  else f"imported_{gv.name_hint}")
                  for gv in _global_vars(o.call) if gv.name_hint in o.callees})
    call = o.call
    # variables are replaced inside tuple arguments too (call_tir's arguments are one tuple)
    args = [tvm_ffi.structural_map(a, [((tvm.ir.Var, tvm.ir.GlobalVar), lambda v: remap.get(v, v))])
            for a in call.args]
    value = bb.emit(relax.Call(call.op, args, call.attrs, list(call.ty_args)))
    if len(o.outputs) == 1:
        env[(o.outputs[0].op, 0)] = value
    else:
        for i, t in enumerate(o.outputs):
            env[(t.op, 0)] = bb.emit(relax.TupleGetItem(value, i))


def is_group_call(value) -> bool:
    """Whether a binding's value in an emitted ``main`` calls a group's PrimFunc (not an opaque
    op's ``call_tir`` of a function the import made)."""
    return (isinstance(value, relax.Call) and getattr(value.op, "name", "") == "relax.call_tir"
            and isinstance(value.args[0], tvm.ir.GlobalVar) and value.args[0].name_hint.startswith(GROUP_PREFIX))


def _global_vars(call: relax.Call) -> list:
    found: list = []
    tvm_ffi.structural_walk(relax.Tuple(list(call.args)), (tvm.ir.GlobalVar, found.append))
    return found
