"""The TIR build pass that points each shared-memory access at the view of its own element type.

TVM's ``MergeSharedMemoryAllocations`` puts a kernel's dynamic shared buffers in one allocation
and re-declares each as a view of its data (``decl_buffer(..., data=buf_dyn_shmem.data)``).
Where the views differ in element type (a tensor-core GEMM accumulating in float32 over its fp16
or bf16 operand tiles), TVM 0.27 rewrites the accumulator's ``tvm_access_ptr`` (a float32
access, its offset in floats) onto the first view, of the operands' type, and its
``LowerAccessPtr`` then stops the build ("tvm_access_ptr element type must match the source
buffer"). Each such access is pointed here at the view of its own type over the same data, which
the merge declared: the same address, typed as the access says. Pointers viewed in one type
alone, and every other call, are left as they are.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import tirx

from ..stitch.kernel_ir import op_name


def _retyped(func: tirx.PrimFunc) -> tirx.PrimFunc:
    views: dict[str, dict[str, object]] = {}      # data pointer (its text) -> element type -> view
    pointer_of: dict = {}                          # view -> its data pointer

    def decl(s):
        pointer_of[s.buffer] = str(s.data)
        views.setdefault(str(s.data), {}).setdefault(str(s.buffer.dtype), s.buffer)

    tvm_ffi.structural_walk(func.body, (tirx.DeclBuffer, decl))
    if all(len(by_type) < 2 for by_type in views.values()):
        return func

    def call(c):
        if op_name(c) != "tirx.tvm_access_ptr" or op_name(c.args[1]) != "tirx.buffer_data":
            return c
        view, wanted = c.args[1].args[0], str(c.args[0].ty.dtype)
        own = views.get(pointer_of.get(view), {}).get(wanted)
        if own is None or str(view.dtype) == wanted:
            return c
        return tvm.ir.Call(c.op, [c.args[0], own.data, *c.args[2:]], ret_ty=c.ty)

    body = tvm_ffi.structural_map(func.body, (tvm.ir.Call, call))
    return func if body.same_as(func.body) else func.with_body(body)


@tvm.transform.module_pass(opt_level=0, name="souffle_tvm.TypedSharedViews")
def typed_shared_views(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """Each device kernel's accesses to a shared pointer viewed in several element types
    addressed through their own view (after TVM's s_tir pipeline, before ``LowerIntrin``)."""
    for gv, f in list(mod.functions.items()):
        if isinstance(f, tirx.PrimFunc) and f.attrs is not None and "tirx.kernel_launch_params" in f.attrs:
            done = _retyped(f)
            if done is not f:
                mod[gv] = done
    return mod
