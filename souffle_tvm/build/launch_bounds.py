"""The TIR build pass that turns a stitched kernel's register cap into ``__launch_bounds__``.

A stitched PrimFunc carries its cap as a function attribute (``MIN_BLOCKS_ATTR``: blocks per
SM nvcc must leave registers for), so the stitcher's checks, the emulator and the race checker
see the same body with or without it. TVM's CUDA codegen reads the cap from an attribute
statement inside the kernel's launch (``TVM_MIN_BLOCKS``, which SplitHostDevice moves onto the
device function), so this pass, first in the TIR pipeline, plants it under ``blockIdx.x``.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import tirx

from ..core.ir_names import MIN_BLOCKS_ATTR, TVM_MIN_BLOCKS
from ..core.root_block import has_root_block, under_root, with_root_block
from ..errors import StitchError


def with_launch_bounds(func: tirx.PrimFunc, blocks: int) -> tirx.PrimFunc:
    """``func`` with ``blocks`` (minimum blocks per SM) planted under its outermost launch: the
    launch's thread extent (a stitched kernel, in launch form), or a scheduled function's
    ``blockIdx.x`` loop (which lowering turns into that launch)."""
    body = under_root(func)
    if not isinstance(body, tirx.AttrStmt):        # a scheduled function: loops bound to blocks
        return _under_block_loop(func, blocks)
    if not (isinstance(body, tirx.AttrStmt) and body.attr_key == "thread_extent"):
        raise StitchError(f"{func.attrs.get('global_symbol', 'kernel')}: no launch at the top of its body")
    cap = tirx.AttrStmt(tirx.const(0, "int32"), TVM_MIN_BLOCKS, tirx.const(blocks, "int32"), body.body)
    capped = func.with_body(tirx.AttrStmt(body.node, body.attr_key, body.value, cap))
    return with_root_block(capped) if has_root_block(func) else capped


def _under_block_loop(func: tirx.PrimFunc, blocks: int) -> tirx.PrimFunc:
    done = []

    def plant(loop):
        binding = loop.thread_binding
        if done or binding is None or str(binding.thread_tag) != "blockIdx.x":
            return loop
        done.append(loop)
        cap = tirx.AttrStmt(tirx.const(0, "int32"), TVM_MIN_BLOCKS, tirx.const(blocks, "int32"), loop.body)
        return tirx.For(loop.loop_var, loop.min, loop.extent, loop.kind, cap, binding, loop.annotations)
    out = func.with_body(tvm_ffi.structural_map(func.body, (tirx.For, plant)))
    if not done:
        raise StitchError(f"{func.attrs.get('global_symbol', 'kernel')}: no blockIdx.x loop to cap")
    return out


@tvm.transform.module_pass(opt_level=0, name="souffle.ApplyRegisterCaps")
def apply_register_caps(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """Plant each capped PrimFunc's ``__launch_bounds__`` minimum blocks (before SplitHostDevice)."""
    for gv, f in list(mod.functions.items()):
        if isinstance(f, tirx.PrimFunc) and f.attrs is not None and MIN_BLOCKS_ATTR in f.attrs:
            mod[gv] = with_launch_bounds(f.without_attr(MIN_BLOCKS_ATTR), int(f.attrs[MIN_BLOCKS_ATTR]))
    return mod
