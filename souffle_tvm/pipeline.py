"""The Souffle pipeline driver: the passes of ``passes.py`` run in order, results collected.

``level`` selects the paper's ablation level by turning passes off by name:
v0 no transforms, v1 + horizontal, v2 + vertical (one kernel per anchor group, no grid sync).
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm

from . import passes, te_program
from .partition import Partition
from .transforms.horizontal import HorizontalResult
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


def run(mod: tvm.IRModule, target: tvm.target.Target, params: list, level: str = "v2") -> SouffleModule:
    """Apply the Souffle pipeline to an imported module (inputs then weights as ``main`` params)."""
    if level not in LEVELS:
        raise ValueError(f"unknown level {level!r}; available: {', '.join(LEVELS)}")
    # Lowering runs first, outside the pass machinery, so a LoweringError reaches the caller
    # as itself (exceptions crossing TVM's FFI come back as RuntimeError) and the caller can
    # fall back to TVM's path; the transforms then run as the passes users compose.
    mod = passes.with_program(mod, te_program.lower(mod, weight_values=params))
    with tvm.transform.PassContext(opt_level=3, disabled_pass=passes.LEVEL_DISABLES[level]):
        out = passes.SoufflePipeline(target, params, lower=False)(mod)
    info = passes.info_of(out)
    clean = out.without_attr(passes.INFO).without_attr(passes.PARAMS)
    return SouffleModule(clean, info["unscheduled"], info["program"], info.get("vertical"),
                         info.get("horizontal"), info["partition"], [p.numpy() for p in passes.params_of(out)])
