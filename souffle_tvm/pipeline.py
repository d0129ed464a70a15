"""The Souffle pipeline driver: the passes of ``passes.py`` run in order, results collected.

``level`` selects the paper's ablation level by turning passes off by name:
v0 no transforms, v1 + horizontal, v2 + vertical (one kernel per anchor group, no grid sync),
v3 + stitching: each subprogram of groups becomes ONE cooperative kernel with grid syncs
(CUDA only; on llvm, the CPU twin, v3 builds the same groups as loop nests).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import tvm

from . import partition, passes, te_program
from .partition import Partition
from .targets import is_cuda
from .transforms.horizontal import HorizontalResult
from .transforms.two_phase import TwoPhaseResult
from .transforms.vertical import VerticalResult

LEVELS = tuple(passes.LEVEL_DISABLES)


@dataclass
class SouffleModule:
    mod: tvm.IRModule              # group PrimFuncs scheduled for the target
    unscheduled: tvm.IRModule      # the same module before scheduling (for flops/bytes)
    program: te_program.TEProgram
    vertical: VerticalResult | None
    horizontal: HorizontalResult | None
    partition: Partition
    params: list                   # weight arrays ``mod["main"]`` takes after the inputs
    stitched: list = field(default_factory=list)      # StitchedKernel per cooperative kernel
    unstitched: tvm.IRModule | None = None            # ``mod`` before stitching (for restitch)
    subprograms: list = field(default_factory=list)   # (group indices, reason for the cut)
    two_phase: TwoPhaseResult | None = None           # reductions split in two, and why others were not


STITCH_BLOCK = 256  # one block size for every stage of a stitched kernel


def run(mod: tvm.IRModule, target: tvm.target.Target, params: list, level: str = "v2",
        gemm_k_tile: int | None = None) -> SouffleModule:
    """Apply the Souffle pipeline to an imported module (inputs then weights as ``main`` params).

    ``gemm_k_tile``: the K tile of stitched GEMM stages (v3, CUDA; default 16); tiles over
    48 KB of shared memory go to dynamic shared memory."""
    if level not in LEVELS:
        raise ValueError(f"unknown level {level!r}; available: {', '.join(LEVELS)}")
    # Lowering runs first, outside the pass machinery, so a LoweringError reaches the caller
    # as itself (exceptions crossing TVM's FFI come back as RuntimeError) and the caller can
    # fall back to TVM's path; the transforms then run as the passes users compose.
    mod = passes.with_program(mod, te_program.lower(mod, weight_values=params))
    stitching = level == "v3" and is_cuda(target)
    with tvm.transform.PassContext(opt_level=3, disabled_pass=passes.LEVEL_DISABLES[level]):
        out = passes.SoufflePipeline(target, params, lower=False, block_size=STITCH_BLOCK if stitching else None,
                                     gemm_k_tile=gemm_k_tile if stitching else None)(mod)
    info = passes.info_of(out)
    clean = out.without_attr(passes.INFO).without_attr(passes.PARAMS)
    result = SouffleModule(clean, info["unscheduled"], info["program"], info.get("vertical"),
                           info.get("horizontal"), info["partition"], [p.numpy() for p in passes.params_of(out)],
                           two_phase=info.get("two_phase"))
    if stitching:
        _stitch(result, target)
    return result


def restitch(result: SouffleModule, target: tvm.target.Target, grids: dict[str, int]) -> SouffleModule:
    """The same subprograms stitched again with per-kernel grid sizes (``{kernel name: blocks}``),
    e.g. the co-resident limit measured from the first build's registers."""
    import dataclasses

    again = dataclasses.replace(result, mod=result.unstitched)
    _stitch(again, target, grids)
    return again


def _stitch(result: SouffleModule, target: tvm.target.Target, grids: dict[str, int] | None = None) -> None:
    """Group the partition's kernels into subprograms and stitch each into one kernel."""
    from . import hardware, stitch

    groups = result.partition.groups
    call_index, n = {}, 0
    for i, g in enumerate(groups):
        if g.opaque is None:
            call_index[i] = n
            n += 1
    calls = [b.value for blk in result.mod["main"].body.blocks for b in blk.bindings
             if isinstance(b.value, tvm.relax.Call) and getattr(b.value.op, "name", "") == "relax.call_tir"]

    def stitchable(i: int) -> str | None:
        return stitch.why_not_stitchable(result.mod[calls[call_index[i]].args[0]], target, STITCH_BLOCK)

    subs = partition.subprograms_by_normalization(groups, partition.readers_of(result.program), stitchable)
    gpu = hardware.for_arch(str(target.attrs["arch"]))
    # One block per SM is co-resident for any kernel that launches at all (256 threads, static
    # shared memory); the co-resident limit of the grids asked for comes from ptxas' figures and
    # is checked by the build (api._check_coresidency).
    result.unstitched = result.mod
    result.mod, result.stitched = stitch.stitch_module(
        result.mod, target, [[call_index[i] for i in idx if i in call_index] for idx, _ in subs],
        grid=gpu.sms, block=STITCH_BLOCK, grids=grids)
    result.subprograms = subs
