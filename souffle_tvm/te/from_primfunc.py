"""A ``call_tir`` already in the imported module, as a TE stage where its PrimFunc allows.

TVM's ONNX importer writes some operators as ``call_tir`` of a PrimFunc it made with
``bb.call_te`` (Clip's NaN-guarded bounds, Tile): ``relax.call_tir`` has no FLegalize, so those
were opaque stages that fused with nothing. A PrimFunc that is one spatial block over its one
output (``out[v...] = f(loads of the inputs at v...)``, the loops covering the output once)
is exactly ``te.compute(out.shape, f)``; anything else (reductions, several blocks, scratch
buffers) stays opaque.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import s_tir, te, tirx

from .rewrite import cast_like


def _blocks(func: tirx.PrimFunc) -> list:
    found: list = []
    tvm_ffi.structural_walk(func.body, (s_tir.SBlockRealize, found.append))
    return [r for r in found if r.block.name_hint != "root" or r.block.iter_vars]


def _loops(func: tirx.PrimFunc) -> dict:
    found: dict = {}
    tvm_ffi.structural_walk(func.body, (tirx.For, lambda f: found.__setitem__(f.loop_var, f)))
    return found


def as_te(func: tirx.PrimFunc, args: list) -> te.Tensor | None:
    """``func(args..., out)`` as one te.compute over ``args`` (te.Tensors), or None."""
    if len(func.params) != len(args) + 1 or not all(isinstance(a, te.Tensor) for a in args):
        return None
    out = func.params[-1]
    realizes = _blocks(func)
    if len(realizes) != 1:
        return None
    realize = realizes[0]
    block = realize.block
    store = block.body
    if (block.init is not None or list(block.alloc_buffers) or list(block.match_buffers)
            or not isinstance(store, tirx.BufferStore) or not store.buffer.same_as(out)):
        return None
    shape = [int(d) for d in out.ty.shape]
    ivs = list(block.iter_vars)
    if len(ivs) != len(shape) or any(iv.iter_type != 0 for iv in ivs) or \
            [int(iv.dom.extent) for iv in ivs] != shape or any(int(iv.dom.min) != 0 for iv in ivs):
        return None
    if len(store.indices) != len(ivs) or not all(i.same_as(iv.var) for i, iv in zip(store.indices, ivs)):
        return None
    # the loops bind each block variable to a distinct loop over exactly its domain
    loops = _loops(func)
    values = list(realize.iter_values)
    if len({id(v) for v in values}) != len(values) or not all(
            isinstance(v, tirx.Var) and v in loops and int(loops[v].min) == 0 and int(loops[v].extent) == e
            for v, e in zip(values, shape)) or len(loops) != len(shape):
        return None
    if not (isinstance(realize.predicate, tirx.IntImm) and int(realize.predicate) == 1):
        return None
    inputs = {p: a for p, a in zip(func.params[:-1], args)}
    ok = [True]

    def body(*idx):
        vmap = {iv.var: cast_like(i, iv.var) for iv, i in zip(ivs, idx)}

        def load(node):
            if isinstance(node, tvm.ir.TensorLoad):
                if node.source not in inputs:
                    ok[0] = False
                    return node
                return inputs[node.source](*node.indices)
            return vmap.get(node, node) if isinstance(node, tirx.Var) else node
        return tvm_ffi.structural_map(store.value, [((tvm.ir.TensorLoad, tirx.Var), load)])

    try:
        result = te.compute([tirx.IntImm("int64", d) for d in shape], body, name=block.name_hint)
    except Exception:  # noqa: BLE001 - any form TE does not take stays opaque
        return None
    return result if ok[0] else None
