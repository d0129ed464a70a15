"""The TIR build pass that marks stitched kernels (those that grid-sync) for a cooperative launch,
and a named TIR pipeline with it for users who build with ``tvm.compile`` themselves:

    ex = tvm.compile(mod, target, relax_pipeline=..., tir_pipeline=COOPERATIVE_TIR_PIPELINE)

TVM's default TIR pipeline has no hook for it: the launch tags are written by
SplitHostDevice, so the flag can only be added after that pass, inside the TIR pipeline.
"""

from __future__ import annotations

import tvm
from tvm import tirx
from tvm.s_tir.pipeline import default_s_tir_pipeline

from ..stitch.kernel_ir import has_grid_sync
from .launch_bounds import apply_register_caps
from .param_names import distinct_param_names


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


def _cooperative_pipeline():
    pipeline, host, device = default_s_tir_pipeline()
    return tvm.transform.Sequential([apply_register_caps, distinct_param_names, pipeline,
                                     attach_cooperative_launch]), host, device


# register caps + distinct parameter names + TVM's s_tir pipeline + the cooperative tag
COOPERATIVE_TIR_PIPELINE = "souffle_tvm.cooperative"
tirx.register_tir_pipeline(COOPERATIVE_TIR_PIPELINE, _cooperative_pipeline)
