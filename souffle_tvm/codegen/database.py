"""The tuning database: MetaSchedule's ``JSONDatabase`` in a work dir, looked up per stage.

``souffle-tvm tune`` writes it; ``compile(..., database=DIR)`` reads it. A stage's record is
found by the structural hash of its unscheduled PrimFunc, normalised exactly as MetaSchedule
normalised it when tuning, and only records made for the same target (kind and CUDA arch)
are applied: MetaSchedule's own ``query_schedule`` ignores the target.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import platform
import sys
import types

import tvm
from tvm import tirx

from ..core.ir_names import NOTE_ATTR, SOURCE_ATTR
from ..errors import SouffleError
from ..core.targets import is_cuda

WORKLOADS = "database_workload.json"
RECORDS = "database_tuning_record.json"


# The tensor intrinsics each target kind's MetaSchedule rules can name, by submodule of
# tvm.s_tir.tensor_intrin (on llvm: this machine's architecture).
_INTRIN_MODULES = {"cuda": ("cuda",), "llvm": ("arm_cpu",) if platform.machine() in ("aarch64", "arm64") else ("x86",)}


def register_tensor_intrinsics(target: tvm.target.Target) -> None:
    """Register the tensor intrinsics ``target``'s schedules can use, and only those.

    MetaSchedule's ``TuneContext`` (and trace replay) import the whole
    ``tvm.s_tir.tensor_intrin`` package for its side effect, registering every target's
    intrinsics: about 30 s here (cuda's alone ~10 s, x86's 0.3 s). When the package is not yet
    imported, its submodules for this target are loaded under a package entry whose
    ``__init__`` does not run, so MetaSchedule's later import finds it done."""
    name = "tvm.s_tir.tensor_intrin"
    if name not in sys.modules:
        spec = importlib.util.find_spec(name)
        pkg = types.ModuleType(name)
        pkg.__path__, pkg.__spec__, pkg.__package__ = list(spec.submodule_search_locations), spec, name
        sys.modules[name] = pkg
    for sub in _INTRIN_MODULES.get(target.kind.name, ()):
        importlib.import_module(f"{name}.{sub}")


def open_database(work_dir: str, create: bool = False):
    """The JSON database in ``work_dir``; without ``create`` it must already hold records."""
    from tvm.s_tir import meta_schedule as ms

    if not create and not os.path.exists(os.path.join(work_dir, RECORDS)):
        raise SouffleError(f"no tuning database in {work_dir!r} (expected {RECORDS}): "
                           "run `souffle-tvm tune MODEL --database DIR` first")
    if create:
        os.makedirs(work_dir, exist_ok=True)
    return ms.database.JSONDatabase(work_dir=work_dir, allow_missing=create)


def record_count(work_dir: str) -> int:
    """Tuning records (one JSON line each) in ``work_dir``."""
    path = os.path.join(work_dir, RECORDS)
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return sum(1 for line in f if line.strip())


def _workload_mod(func: tirx.PrimFunc) -> tvm.IRModule:
    # The normalisation MetaSchedule applied when the task was tuned: the same function gives
    # the same module, hence the same structural hash.
    from tvm.s_tir.meta_schedule.tune_context import _normalize_mod

    return _normalize_mod(func)


def known(database, func: tirx.PrimFunc) -> bool:
    """Whether this stage was ever given to the tuner (even if no candidate of it ran)."""
    return bool(database.has_workload(_workload_mod(func)))


def measured(database, func: tirx.PrimFunc) -> tuple[int, float | None]:
    """(valid measured records, best mean run seconds) for this stage."""
    mod = _workload_mod(func)
    if not database.has_workload(mod):
        return 0, None
    records = database.get_top_k(database.commit_workload(mod), 1 << 30)
    if not records:
        return 0, None
    best = records[0].run_secs
    return len(records), (sum(float(s) for s in best) / len(best)) if best else None


def same_target(a: tvm.target.Target, b: tvm.target.Target) -> bool:
    if a.kind.name != b.kind.name:
        return False
    return not is_cuda(a) or str(a.attrs.get("arch", "")) == str(b.attrs.get("arch", ""))


def lookup(database, func: tirx.PrimFunc, target: tvm.target.Target) -> tuple[tirx.PrimFunc | None, str | None]:
    """The best tuned schedule of ``func`` for ``target``, or (None, why not) — why is None when
    the stage was simply never tuned."""
    from tvm import s_tir

    mod = _workload_mod(func)
    if not database.has_workload(mod):
        return None, None
    records = database.get_top_k(database.commit_workload(mod), 64)
    for rec in records:
        if not same_target(rec.target, target):
            continue
        if any(inst.kind.name == "Tensorize" for inst in rec.trace.insts):
            # the intrinsics a tensor-core trace names must be registered before replaying it
            register_tensor_intrinsics(target)
        sch = s_tir.Schedule(rec.workload.mod)
        rec.trace.apply_to_schedule(sch, remove_postproc=False)
        # The group PrimFuncs carry no global symbol (the Relax module names them).
        return sch.mod["main"].without_attr("global_symbol"), None
    if not records:
        return None, "tuned, but no candidate ran successfully"
    kinds = sorted({str(r.target.kind.name) + (f" {r.target.attrs.get('arch')}" if is_cuda(r.target) else "")
                    for r in records})
    return None, f"tuned for {', '.join(kinds)}, not this target"


def schedule_source(func: tirx.PrimFunc) -> tuple[str | None, str | None]:
    """(where a scheduled group PrimFunc's schedule came from, why not the database) as the
    schedule cache marked it; (None, None) when no database was in use."""
    attrs = func.attrs or {}
    source = str(attrs[SOURCE_ATTR]) if SOURCE_ATTR in attrs else None
    note = str(attrs[NOTE_ATTR]) if NOTE_ATTR in attrs else None
    return source, note
