"""Every PrimFunc handed to TVM sits under a root block.

TVM's passes expect a function that is not yet lowered to have its body under one root
``SBlockRealize``; Relax's reshape detection (``relax.analysis.has_reshape_pattern``, run by
``RewriteDataflowReshape`` on every ``call_tir`` with one input) aborts on a function without
one ("Check failed: func->body->IsInstance<SBlockRealizeNode>()"). A stitched kernel is built
in launch form (thread-extent attributes, no blocks), so it needs the root block added before
TVM sees it; TVM's lowering (ConvertBlocksToOpaque, LowerOpaqueBlock) removes it again.
"""

from __future__ import annotations

import tvm
from tvm import s_tir, tirx

from ..errors import SouffleError


def has_root_block(func: tirx.PrimFunc) -> bool:
    return isinstance(func.body, s_tir.SBlockRealize)


def with_root_block(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` with its body under a root block (unchanged if it has one)."""
    if has_root_block(func):
        return func
    return func.with_body(s_tir.SBlockRealize([], True, s_tir.SBlock([], [], [], "root", func.body)))


def under_root(func: tirx.PrimFunc) -> tirx.Stmt:
    """The body below the root block, if any (a launch-form kernel's first launch attribute)."""
    return func.body.block.body if has_root_block(func) else func.body


def without_root_block(mod: tvm.IRModule) -> list[str]:
    """The names of ``mod``'s PrimFuncs that lack a root block."""
    return sorted(gv.name_hint for gv, f in mod.functions.items()
                  if isinstance(f, tirx.PrimFunc) and not has_root_block(f))


def ensure_root_blocks(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` with every PrimFunc under a root block (a copy if any was changed)."""
    missing = set(without_root_block(mod))
    if not missing:
        return mod
    out = mod.clone()
    for gv, f in list(mod.functions.items()):
        if gv.name_hint in missing:
            out[gv] = with_root_block(f)
    return out


def require_root_blocks(mod: tvm.IRModule, where: str) -> tvm.IRModule:
    """``mod`` unchanged; raises (a bug in ``where``) if a PrimFunc lacks a root block."""
    missing = without_root_block(mod)
    if missing:
        raise SouffleError(f"{where} emitted PrimFuncs without a root block (TVM's Relax passes abort on "
                           f"them): {', '.join(missing)}")
    return mod
