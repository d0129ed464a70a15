"""TVM's s_tir pipeline with the stitched kernels' buffers compacted once, not twice.

A stitched kernel comes to the build in launch form (``stitch.lower``): each stage's buffers
were compacted when the stage was lowered alone, with its block index a launch variable. The
default pipeline's ``CompactBufferAllocation`` then runs over the stitched kernel again, where
that index is the grid-stride expression ``(it * grid + blockIdx.x) % blocks``. On a window
tile whose halo TVM clipped at the map's borders (``WindowChain``: offsets of the form
``x - max(0, x - 1)``) the analyser can no longer bound the region, and the tile grows to the
whole map: full-size EfficientNet-B0's first stitched kernel went from 8 x 29 x 29 floats to
8 x 113 x 113, 440 KB of static shared memory, which ptxas refuses. So the stitched kernels run
the same pipeline with that one pass left out; every other function runs it whole.
"""

from __future__ import annotations

import tvm

from ..stitch.lower import in_launch_form

RECOMPACTION = "s_tir.CompactBufferAllocation"


@tvm.ir.instrument.pass_instrument
class _SkipRecompaction:
    def should_run(self, mod, info) -> bool:
        return info.name != RECOMPACTION


def compacted_once(pipeline: tvm.transform.Pass) -> tvm.transform.Pass:
    """``pipeline`` (TVM's s_tir pipeline) over a module, its launch-form functions without
    ``CompactBufferAllocation``; the two halves' results are one module again."""

    @tvm.transform.module_pass(opt_level=0, name="souffle.CompactedOnce")
    def run(mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        kept = {gv for gv, f in mod.functions.items() if in_launch_form(f)}
        if not kept:
            return pipeline(mod)
        def part(inside: bool) -> tvm.IRModule:
            return tvm.IRModule({gv: f for gv, f in mod.functions.items() if (gv in kept) == inside},
                                attrs=mod.attrs, global_infos=mod.global_infos)

        rest, launch = part(False), part(True)
        out = pipeline(rest) if rest.functions else None
        with tvm.transform.PassContext(opt_level=ctx.opt_level, required_pass=ctx.required_pass,
                                       disabled_pass=ctx.disabled_pass, config=ctx.config,
                                       instruments=[*ctx.instruments, _SkipRecompaction()]):
            launch = pipeline(launch)
        if out is None:
            return launch
        out.update(launch)
        return out

    return run
