"""The TIR build pass that gives each PrimFunc's buffer parameters distinct names.

topi names an activation's input and output ``compute`` alike, so a group PrimFunc often has two
parameters of one name. TVM's lowering keeps parameter names on the device kernels' buffers and
nothing else of their identity, so the kernel inventory (``executable.record_device_kernels``)
traces a kernel's buffers back to parameter positions through these names: they must differ.
First in both TIR pipelines (the driver's and ``cooperative.COOPERATIVE_TIR_PIPELINE``), so the
two build the very same kernels.
"""

from __future__ import annotations

import tvm
from tvm import tirx

from ..cost import tir_stats


@tvm.transform.module_pass(opt_level=0, name="souffle_tvm.DistinctParamNames")
def distinct_param_names(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """Each PrimFunc with its repeated parameter names made distinct (``tir_stats.distinct_param_names``)."""
    for gv, f in list(mod.functions.items()):
        if isinstance(f, tirx.PrimFunc):
            renamed = tir_stats.distinct_param_names(f)
            if renamed is not f:
                mod[gv] = renamed
    return mod
