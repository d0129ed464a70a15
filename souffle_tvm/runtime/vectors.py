"""How the emulator runs a vectorized loop: as TVM's build will.

A vectorized loop TVM's VectorizeLoop turns into vector instructions is one access per thread
on the GPU (a ``float2``/``float4`` load or store); the emulator runs it inside each thread, its
elements marked (``EMULATED_VECTOR``) so the traffic counter counts them as one request. One
VectorizeLoop scalarizes instead runs as a serial loop of scalar accesses, as it is built.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import tirx

from ..core.ir_names import EMULATED_VECTOR


def as_built(low: tirx.PrimFunc, target: tvm.target.Target) -> tirx.PrimFunc:
    """``low`` with each vectorized loop that TVM's build scalarizes (VectorizeLoop meets a call
    it cannot vectorize: ``erf``, ``if_then_else``) made serial, each element its own access: a
    vectorized loop left is one access per thread (``lockstep.Block.run``), as on the GPU."""
    vectors = []

    def rename(loop):
        if loop.kind != tirx.ForKind.VECTORIZED:
            return loop
        var = tirx.Var(f"{loop.loop_var.name}_v{len(vectors)}", loop.loop_var.ty)
        vectors.append(str(var.name))
        body = tvm_ffi.structural_map(loop.body, (tirx.Var, lambda v: var if v.same_as(loop.loop_var) else v))
        return tirx.For(var, loop.min, loop.extent, loop.kind, body, annotations=loop.annotations)
    low = tirx.PrimFunc(low.params, tvm_ffi.structural_map(low.body, (tirx.For, rename)), attrs=low.attrs)
    if not vectors:
        return low
    with target:
        built = tvm.transform.Sequential([tirx.transform.FlattenBuffer(), tirx.transform.VectorizeLoop(True)])(
            tvm.IRModule({"k": low}))["k"]
    left = []       # VectorizeLoop's scalarized loop: a serial one over "<name>.s"
    tvm_ffi.structural_walk(built.body, (tirx.For, lambda f: left.append(str(f.loop_var.name))))
    scalar = {n for n in vectors if f"{n}.s" in left}

    def scalarized(loop):
        if loop.kind == tirx.ForKind.VECTORIZED and str(loop.loop_var.name) in scalar:
            return tirx.For(loop.loop_var, loop.min, loop.extent, tirx.ForKind.SERIAL, loop.body)
        return loop
    return tirx.PrimFunc(low.params, tvm_ffi.structural_map(low.body, (tirx.For, scalarized)), attrs=low.attrs)


def serial(stmt: tirx.Stmt) -> tirx.Stmt:
    """Vectorized/unrolled loops become serial: the CPU program need not vectorise. A vectorized
    one keeps a mark (``EMULATED_VECTOR``): its elements were one access on the GPU."""
    def plain(f):
        if f.kind == tirx.ForKind.SERIAL:
            return f
        marks = {EMULATED_VECTOR: 1} if f.kind == tirx.ForKind.VECTORIZED else {}
        return tirx.For(f.loop_var, f.min, f.extent, tirx.ForKind.SERIAL, f.body, annotations=marks)
    return tvm_ffi.structural_map(stmt, (tirx.For, plain))
