"""The TIR build pass that marks stitched kernels (those that grid-sync) for a cooperative launch,
and a named TIR pipeline with it for users who build with ``tvm.compile`` themselves:

    ex = tvm.compile(mod, target, relax_pipeline=..., tir_pipeline=COOPERATIVE_TIR_PIPELINE)

TVM's default TIR pipeline has no hook for it: the launch tags are written by
SplitHostDevice, so the flag can only be added after that pass, inside the TIR pipeline.

A kernel built with TVM's default TIR pipeline instead launches without the flag, and its
first ``grid.sync()`` is undefined. ``guard_grid_sync`` (the pass form's last step) makes each
such kernel check, once at entry, that its grid is a valid cooperative grid and trap
(a device-side assert naming this pipeline, then ``__trap()``) when it is not;
``COOPERATIVE_TIR_PIPELINE`` removes the check again, since it adds the flag itself.
"""

from __future__ import annotations

import tvm
from tvm import tirx
from tvm.s_tir.pipeline import default_s_tir_pipeline

from tvm.backend.cuda.op import cuda_func_call

from ..core.root_block import has_root_block, under_root, with_root_block
from ..stitch.kernel_ir import has_grid_sync, op_name
from .compacted_once import compacted_once
from .dynamic_shared import dynamic_shared_over_limit
from .launch_bounds import apply_register_caps
from .param_names import distinct_param_names
from .typed_views import typed_shared_views


@tvm.transform.module_pass(opt_level=0, name="souffle.AttachCooperativeLaunch")
def attach_cooperative_launch(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """Mark device kernels that grid-sync for a cooperative launch (after SplitHostDevice).

    The dynamic-shared-memory tag must stay last: the runtime checks for it there.
    """
    for gv, f in list(mod.functions.items()):
        lp = f.attrs.get("tirx.kernel_launch_params") if isinstance(f, tirx.PrimFunc) and f.attrs else None
        if lp is None or not has_grid_sync(f) or "tirx.use_cooperative_launch" in list(lp):
            continue
        tags = list(lp)
        pos = len(tags) - (1 if tags and tags[-1] == "tirx.use_dyn_shared_memory" else 0)
        tags.insert(pos, "tirx.use_cooperative_launch")
        mod[gv] = f.with_attr("tirx.kernel_launch_params", tags)
    return mod


# -- the entry check of a kernel that may be launched without the flag -----------------------------
GUARD = "souffle_require_cooperative_grid"
_FUNC_CALL = "tirx.cuda.func_call"
# One check per thread at entry, none per sync. ``assert`` prints why (and is gone under NDEBUG,
# hence the ``__trap()``); cooperative_groups.h is in the source of every kernel that grid-syncs.
GUARD_SOURCE = f"""
__device__ __forceinline__ void {GUARD}() {{
  if (!cooperative_groups::this_grid().is_valid()) {{
    assert(!"souffle-tvm: stitched kernel launched without the cooperative flag; build it with "
            "tvm.compile(..., tir_pipeline=souffle_tvm.transform.COOPERATIVE_TIR_PIPELINE)");
    __trap();
  }}
}}
"""


def _is_guard(stmt) -> bool:
    return (isinstance(stmt, tirx.Evaluate) and op_name(stmt.value) == _FUNC_CALL
            and getattr(stmt.value.args[0], "value", None) == GUARD)


def _entry(func: tirx.PrimFunc) -> tuple[list, list]:
    """The launch attributes around ``func``'s body (below its root block, if any), and the
    statements just inside them."""
    node, attrs = under_root(func), []
    while isinstance(node, tirx.AttrStmt) and node.attr_key == "thread_extent":
        attrs.append(node)
        node = node.body
    return attrs, (list(node.seq) if isinstance(node, tirx.SeqStmt) else [node])


def _with_entry(func: tirx.PrimFunc, attrs: list, seq: list) -> tirx.PrimFunc:
    body = tirx.SeqStmt(seq) if len(seq) > 1 else seq[0]
    for a in reversed(attrs):
        body = tirx.AttrStmt(a.node, a.attr_key, a.value, body)
    out = tirx.PrimFunc(func.params, body, attrs=func.attrs)
    return with_root_block(out) if has_root_block(func) else out


def has_guard(func: tirx.PrimFunc) -> bool:
    """Whether ``func`` starts with the cooperative-grid check."""
    return any(_is_guard(s) for s in _entry(func)[1])


def guard_grid_sync(mod: tvm.IRModule) -> tuple[tvm.IRModule, list[str]]:
    """``mod`` with every PrimFunc that grid-syncs checking its grid at entry, and their names."""
    guarded = []
    for gv, f in list(mod.functions.items()):
        if not isinstance(f, tirx.PrimFunc) or not has_grid_sync(f) or has_guard(f):
            continue
        attrs, seq = _entry(f)
        if not attrs:       # not in launch form (no kernel yet): nothing to guard
            continue
        mod[gv] = _with_entry(f, attrs, [tirx.Evaluate(cuda_func_call(GUARD, source_code=GUARD_SOURCE))] + seq)
        guarded.append(gv.name_hint)
    return mod, guarded


@tvm.transform.module_pass(opt_level=0, name="souffle.DropCooperativeGuard")
def drop_cooperative_guard(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """Remove the entry check ``guard_grid_sync`` planted: this pipeline launches cooperatively."""
    for gv, f in list(mod.functions.items()):
        if isinstance(f, tirx.PrimFunc) and has_guard(f):
            attrs, seq = _entry(f)
            mod[gv] = _with_entry(f, attrs, [s for s in seq if not _is_guard(s)])
    return mod


def _cooperative_pipeline():
    pipeline, host, device = default_s_tir_pipeline()
    return tvm.transform.Sequential([drop_cooperative_guard, dynamic_shared_over_limit, apply_register_caps,
                                     distinct_param_names, compacted_once(pipeline), typed_shared_views, attach_cooperative_launch]), host, device


# the entry check dropped + shared memory over 48 KB made dynamic + register caps + distinct parameter
# names + TVM's s_tir pipeline (stitched kernels compacted once: ``compacted_once``) + the cooperative tag
COOPERATIVE_TIR_PIPELINE = "souffle_tvm.cooperative"
tirx.register_tir_pipeline(COOPERATIVE_TIR_PIPELINE, _cooperative_pipeline)
