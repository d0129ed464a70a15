"""Drop-in passes: the Souffle pipeline as ``tvm.transform.Pass`` objects on a Relax IRModule.

Between ``LowerToTE`` and ``PartitionAndEmit`` the module carries its TEProgram in the module
attribute ``souffle.te_program``; each transform reads it, rewrites it and stores it back, so
the passes compose in ``tvm.transform.Sequential`` and respect ``PassContext``
(``disabled_pass=["souffle.HorizontalFusion"]`` turns one off; instruments see each one).
``PartitionAndEmit`` replaces ``main`` with calls to one PrimFunc per kernel group and leaves
the weights ``main`` now takes in the attribute ``souffle.params`` (:func:`params_of`).

    seq = tvm.transform.Sequential([relax.transform.FoldConstant(), SoufflePipeline(target, params)])
    mod = seq(mod); ex = tvm.compile(mod, target)
"""

from __future__ import annotations

import numpy as np
import tvm
import tvm_ffi

from ..codegen import emit, schedule
from ..partition import groups as partition
from ..stitch import kernel as stitch
from ..te import program as te_program
from ..codegen.database import lookup
from ..core.ir_names import NOTE_ATTR, SOURCE_ATTR
from ..errors import ScheduleError, SouffleError
from ..core.targets import is_cuda
from ..transforms import fold_weights, horizontal, two_phase, vertical

PROGRAM = "souffle.te_program"
INFO = "souffle.info"
PARAMS = "souffle.params"


def _program(mod: tvm.IRModule) -> te_program.TEProgram:
    if mod.attrs is None or PROGRAM not in mod.attrs:
        raise SouffleError("this Souffle pass needs a TEProgram: run souffle_tvm.passes.LowerToTE() first")
    return mod.attrs[PROGRAM]


def _info(mod: tvm.IRModule) -> dict:
    return dict(mod.attrs[INFO]) if mod.attrs is not None and INFO in mod.attrs else {}


def _store(mod: tvm.IRModule, prog, **info) -> tvm.IRModule:
    merged = {**_info(mod), **info}
    return mod.with_attr(PROGRAM, tvm_ffi.convert(prog)).with_attr(INFO, tvm_ffi.convert(merged))


def with_program(mod: tvm.IRModule, prog: te_program.TEProgram) -> tvm.IRModule:
    """Attach an already lowered TEProgram (what ``LowerToTE`` does)."""
    return _store(mod, prog)


def info_of(mod: tvm.IRModule) -> dict:
    """What the passes recorded: transform results, the partition."""
    return _info(mod)


def params_of(mod: tvm.IRModule) -> list[np.ndarray]:
    """The weights the emitted ``main`` takes after its inputs."""
    return list(mod.attrs[PARAMS]) if mod.attrs is not None and PARAMS in mod.attrs else []


@tvm.transform.module_pass(opt_level=0, name="souffle.LowerToTE")
class LowerToTE:
    """Relax ``main`` → one TEProgram (weights as placeholders, their values when given).

    ``params``: the weight arrays in ``main``'s parameter order after the inputs; if None,
    the ``params`` function attribute that ``from_onnx(keep_params_in_input=True)`` leaves.
    """

    def __init__(self, params: list | None = None):
        self.params = params

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        params = self.params
        main = mod["main"]
        if params is None and main.attrs is not None and "params" in main.attrs:
            params = [p.numpy() for p in main.attrs["params"]]
        return _store(mod, te_program.lower(mod, weight_values=params))


def _transform_pass(name: str, fn, key: str):
    @tvm.transform.module_pass(opt_level=0, name=name)
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        result = fn(_program(mod))
        return _store(mod, result.program, **{key: result})

    _pass.__doc__ = fn.__doc__
    return _pass


def FoldWeights() -> tvm.transform.Pass:  # noqa: N802 - named like TVM's pass constructors
    """Evaluate weight-only stages at compile time (see ``transforms.fold_weights``)."""
    return _transform_pass("souffle.FoldWeights", fold_weights, "fold_weights")


def HorizontalFusion() -> tvm.transform.Pass:  # noqa: N802
    """Merge isomorphic independent contractions (see ``transforms.horizontal``)."""
    return _transform_pass("souffle.HorizontalFusion", horizontal, "horizontal")


def VerticalFusion() -> tvm.transform.Pass:  # noqa: N802
    """Compose one-to-one chains into consumers (see ``transforms.vertical``)."""
    return _transform_pass("souffle.VerticalFusion", vertical, "vertical")


def TwoPhaseReduction(atomic: bool = False) -> tvm.transform.Pass:  # noqa: N802
    """Split GEMM-fed row reductions into block partials and a combine (see ``transforms.two_phase``);
    ``atomic``: fp32 sums accumulate with atomicAdd instead (CUDA)."""
    return _transform_pass("souffle.TwoPhaseReduction", lambda prog: two_phase(prog, atomic=atomic), "two_phase")


@tvm.transform.module_pass(opt_level=0, name="souffle.PartitionAndEmit")
class PartitionAndEmit:
    """Draw kernel boundaries (with schedule feedback on CUDA) and emit one PrimFunc per group."""

    def __init__(self, target: tvm.target.Target | None = None, block_size: int | None = None,
                 gemm_k_tile: int | None = None, database=None):
        self.target = target
        self.block_size = block_size
        self.gemm_k_tile = gemm_k_tile
        self.database = database

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        target = self.target or tvm.target.Target.current(allow_none=True) or tvm.target.Target({"kind": "llvm"})
        prog = _program(mod)
        scheduled = _ScheduleCache(target, self.block_size, self.gemm_k_tile, self.database)
        part = partition.partition_v2(prog, fits=scheduled.fits)
        out = emit.emit_module(prog, part, schedule=lambda f: scheduled(f).func)
        info = {**_info(mod), "partition": part, "program": prog,
                "unscheduled": emit.emit_module(prog, part)}
        return (out.with_attr(PARAMS, tvm_ffi.convert([tvm.runtime.tensor(a) for a in prog.weight_arrays()]))
                .with_attr(INFO, tvm_ffi.convert(info)))


class _ScheduleCache:
    """Each structurally distinct group PrimFunc is scheduled once: from the tuning database
    when it holds a usable record for it (``database.lookup``), else by the default rules."""

    def __init__(self, target, block_size: int | None = None, gemm_k_tile: int | None = None, database=None):
        self.target = target
        self.block_size = block_size
        self.gemm_k_tile = gemm_k_tile
        self.database = database
        self.cache: dict = {}

    def __call__(self, func) -> schedule.Scheduled:
        bucket = self.cache.setdefault(tvm_ffi.structural_hash(func), [])
        for seen, done in bucket:
            if tvm_ffi.structural_equal(seen, func):
                return done
        done = self._tuned(func) if self.database is not None else None
        if not isinstance(done, schedule.Scheduled):
            why = done
            done = schedule.schedule_group(func, self.target, self.block_size, self.gemm_k_tile)
            if self.database is not None:    # say where each schedule came from (the report reads it)
                out = done.func.with_attr(SOURCE_ATTR, f"default: {done.rule}")
                done = schedule.Scheduled(out.with_attr(NOTE_ATTR, why) if why else out, done.rule, done.notes)
        bucket.append((func, done))
        return done

    def _tuned(self, func) -> schedule.Scheduled | str | None:
        """The database's schedule of ``func``, or why its record cannot be used (None: no record)."""
        tuned, why = lookup(self.database, func, self.target)
        if tuned is None:
            return why
        if self.block_size is not None and is_cuda(self.target):
            # A stitched kernel has ONE block size: a tuned stage with other thread counts (or
            # virtual threads) would be refused by the stitcher, so the default rules keep it.
            bad = stitch.why_not_stitchable(tuned, self.target, self.block_size)
            if bad is not None:
                return f"tuned schedule not used: {bad}"
        out = tuned.with_attr("tirx.is_scheduled", True).with_attr(SOURCE_ATTR, "database")
        return schedule.Scheduled(out, "database")

    def fits(self, group: partition.Group, outputs: list) -> str | None:
        """None when the group schedules as well as its anchor does alone; else why not."""
        func, _ = emit.group_primfunc(group, outputs)
        try:
            done = self(func)
        except ScheduleError as err:
            return str(err)
        rule = done.rule
        anchor = group.anchor
        if anchor is None or len(group.members) == 1:
            return None
        alone, _ = emit.group_primfunc(partition.Group([anchor]), [anchor])
        try:
            anchor_rule = self(alone).rule
        except ScheduleError:
            return None
        if schedule.RANK[rule] < schedule.RANK[anchor_rule]:
            # why the anchor's rule did not take the fused group, when it said so (notes are
            # "Rule: why" joined by "; ")
            why = [n for n in done.notes.split("; ") if n.split(":")[0] in (anchor_rule, f"{anchor_rule}256")]
            because = f" ({why[0]})" if why else ""
            return f"fused, dlight schedules it with {rule}{because}; the anchor alone gets {anchor_rule}"
        return None


LEVEL_DISABLES = {"v0": ["souffle.HorizontalFusion", "souffle.VerticalFusion", "souffle.TwoPhaseReduction"],
                  "v1": ["souffle.VerticalFusion", "souffle.TwoPhaseReduction"],
                  "v2": ["souffle.TwoPhaseReduction"], "v3": [], "v4": []}


def SoufflePipeline(target: tvm.target.Target | None = None, params: list | None = None,  # noqa: N802
                    lower: bool = True, block_size: int | None = None,
                    gemm_k_tile: int | None = None, atomic_reductions: bool = False,
                    database=None) -> tvm.transform.Pass:
    """LowerToTE → FoldWeights → HorizontalFusion → VerticalFusion → TwoPhaseReduction → PartitionAndEmit.

    ``lower=False`` starts from a module that already carries its TEProgram (``with_program``).
    ``database``: a MetaSchedule database (``souffle_tvm.database.open_database``) whose tuned
    schedules replace the default rules for the groups it holds.
    """
    steps = [LowerToTE(params)] if lower else []
    steps += [FoldWeights(), HorizontalFusion(), VerticalFusion(), TwoPhaseReduction(atomic_reductions),
              PartitionAndEmit(target, block_size, gemm_k_tile, database)]
    return tvm.transform.Sequential(steps, opt_level=0, name="souffle.Pipeline")
