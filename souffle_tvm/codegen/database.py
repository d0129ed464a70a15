"""The tuning database: MetaSchedule's ``JSONDatabase`` in a work dir, looked up per stage.

``souffle-tvm tune`` writes it; ``compile(..., database=DIR)`` reads it. A stage's record is
found by the structural hash of its unscheduled PrimFunc, normalised exactly as MetaSchedule
normalised it when tuning, and only records made for the same target (kind and CUDA arch)
are applied: MetaSchedule's own ``query_schedule`` ignores the target.

The files: ``database_workload.json`` (one ``[shash, module]`` line per workload) and
``database_tuning_record.json`` (one ``[workload line index, record]`` line per measured
candidate). MetaSchedule's ``JSONDatabase`` appends a line to them for every commit, in
place, so a process killed mid-append leaves a cut line, and the next load fails inside TVM.
So tuning never writes there directly: it tunes into a staged copy (``staged``: a temporary
directory) and after each stage *merges* its new lines into ``DIR`` (under a lock, re-reading
``DIR`` first so concurrent tunes add up) by writing both files anew and renaming each over
the old one, workloads first (records only point back into workloads, which only grow): a
reader sees a whole database, before or after a merge, never a part. Reading
(``open_database``) checks every line; unreadable ones (a cut line from before this scheme,
an index out of range) are skipped with a one-line note (``CacheWarning``), not handed to TVM.
``open_database(DIR, create=True)`` still opens ``DIR`` itself: whoever commits through it
appends in place, non-atomically (tests do, to plant hand-made records).
"""

from __future__ import annotations

import contextlib
import dis
import importlib
import importlib.util
import inspect
import itertools
import json
import linecache
import os
import platform
import shutil
import sys
import tempfile
import threading
import types
from collections.abc import Iterator

import tvm
from tvm import tirx

from ..core.files import atomic_write, note_recomputed
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
        if f"{name}.{sub}" not in sys.modules:
            with _cheap_stacks():
                importlib.import_module(f"{name}.{sub}")


_INSPECT_STACK = inspect.stack
_STACK_LOCK = threading.Lock()


def _stack(context: int = 1) -> list[inspect.FrameInfo]:
    """``inspect.stack()`` with each frame's line from ``linecache``, not from ``inspect.getmodule``
    (one line of context at most: all the TVMScript parser reads)."""
    frames, frame = [], sys._getframe(1)
    while frame is not None:
        code, lineno = frame.f_code, frame.f_lineno
        line = linecache.getline(code.co_filename, lineno) if context > 0 else ""
        positions = next(itertools.islice(code.co_positions(), frame.f_lasti // 2, None), None)
        positions = dis.Positions(*positions) if positions else None
        frames.append(inspect.FrameInfo(frame, code.co_filename, lineno, code.co_name, [line] if line else None,
                                        0 if line else None, positions=positions))
        frame = frame.f_back
    return frames


@contextlib.contextmanager
def _cheap_stacks():
    """Each of the ~180 TVMScript functions the cuda intrinsics module parses calls
    ``inspect.stack()``, which looks up every frame's module by scanning ``sys.modules``: 10-15 s
    of a compile with TVM's ~3000 modules loaded (docs/tvm-workarounds.md). The parser reads only
    the frames, their code and one line of context, so they are built directly meanwhile."""
    with _STACK_LOCK:      # never restore another thread's replacement as the original
        inspect.stack = _stack
        try:
            yield
        finally:
            inspect.stack = _INSPECT_STACK


def open_database(work_dir: str, create: bool = False):
    """The JSON database in ``work_dir``; without ``create`` it must already hold records, and
    lines that cannot be read are skipped with a note (the files are left as they are)."""
    from tvm.s_tir import meta_schedule as ms

    if not create and not os.path.exists(os.path.join(work_dir, RECORDS)):
        raise SouffleError(f"no tuning database in {work_dir!r} (expected {RECORDS}): "
                           "run `souffle-tvm tune MODEL --database DIR` first")
    if create:
        os.makedirs(work_dir, exist_ok=True)
        return ms.database.JSONDatabase(work_dir=work_dir, allow_missing=True)
    workloads, records, dropped = read_lines(work_dir)
    if not dropped:
        return ms.database.JSONDatabase(work_dir=work_dir, allow_missing=False)
    with tempfile.TemporaryDirectory(prefix="souffle_db_") as clean:   # JSONDatabase reads it all at once
        _write_lines(clean, workloads, records)
        return ms.database.JSONDatabase(work_dir=clean, allow_missing=False)


def record_count(work_dir: str) -> int:
    """Tuning records (one JSON line each, readable ones) in ``work_dir``."""
    return len(read_lines(work_dir, quiet=True)[1])


# -- the files, line by line -------------------------------------------------------------------
def _lines(path: str) -> list[str]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8", errors="replace") as f:
        return [ln.rstrip("\n") for ln in f if ln.strip()]


def _workload_ok(line: str) -> bool:
    try:
        w = json.loads(line)
    except ValueError:
        return False
    return isinstance(w, list) and len(w) == 2 and all(isinstance(x, str) for x in w)


def _record_index(line: str) -> int | None:
    """The workload index a record line points at, or None when the line is not a record."""
    try:
        r = json.loads(line)
    except ValueError:
        return None
    ok = isinstance(r, list) and len(r) == 2 and isinstance(r[0], int) and isinstance(r[1], list)
    return r[0] if ok else None


def _with_index(line: str, index: int) -> str:
    # ``[<index>,<record>]``: the record's text is kept byte for byte (no float round trip)
    return f"[{index}," + line[line.index(",") + 1:]


def read_lines(work_dir: str, quiet: bool = False) -> tuple[list[str], list[str], int]:
    """(workload lines, record lines re-pointed at them, how many lines were dropped): the
    readable part of the database in ``work_dir``, with a note for what was dropped."""
    raw_w, raw_r = _lines(os.path.join(work_dir, WORKLOADS)), _lines(os.path.join(work_dir, RECORDS))
    workloads, where = [], {}
    for i, line in enumerate(raw_w):
        if _workload_ok(line):
            where[i] = len(workloads)
            workloads.append(line)
    records = []
    for line in raw_r:
        index = _record_index(line)
        if index in where:
            records.append(_with_index(line, where[index]))
    dropped = len(raw_w) - len(workloads) + len(raw_r) - len(records)
    if dropped and not quiet:
        note_recomputed(work_dir, f"{len(raw_w) - len(workloads)} workload and {len(raw_r) - len(records)} tuning "
                        "record lines cannot be read (cut by a killed tuning run?)", "skipping them")
    return workloads, records, dropped


def _write_lines(work_dir: str, workloads: list[str], records: list[str]) -> None:
    # workloads first: a reader between the two renames sees more workloads than records use
    atomic_write(os.path.join(work_dir, WORKLOADS), "".join(f"{ln}\n" for ln in workloads))
    atomic_write(os.path.join(work_dir, RECORDS), "".join(f"{ln}\n" for ln in records))


@contextlib.contextmanager
def _locked(work_dir: str) -> Iterator[None]:
    """One merge into ``work_dir`` at a time (readers need no lock: every file is renamed in whole)."""
    try:
        import fcntl
    except ImportError:              # not POSIX: merges are still atomic, concurrent ones may lose lines
        yield
        return
    with open(os.path.join(work_dir, ".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class Staging:
    """A tuning run's own copy of the database (``staged``): MetaSchedule appends there;
    ``merge`` moves what it added into the real directory atomically."""

    def __init__(self, work_dir: str, stage_dir: str):
        from tvm.s_tir import meta_schedule as ms

        self.work_dir, self.stage_dir = work_dir, stage_dir
        os.makedirs(work_dir, exist_ok=True)
        workloads, records, _ = read_lines(work_dir)
        _write_lines(stage_dir, workloads, records)
        self.merged_workloads, self.merged_records = len(workloads), len(records)
        self.database = ms.database.JSONDatabase(work_dir=stage_dir, allow_missing=False)

    def merge(self) -> int:
        """Add the staged lines not merged yet to the real database; returns how many records."""
        staged_w = _lines(os.path.join(self.stage_dir, WORKLOADS))
        staged_r = _lines(os.path.join(self.stage_dir, RECORDS))
        new_w, new_r = staged_w[self.merged_workloads:], staged_r[self.merged_records:]
        if not new_w and not new_r:
            return 0
        with _locked(self.work_dir):
            workloads, records, _ = read_lines(self.work_dir, quiet=True)   # as it is now: others may have merged
            index = {line: i for i, line in enumerate(workloads)}
            def at(workload: str) -> int:
                if workload not in index:
                    index[workload] = len(workloads)
                    workloads.append(workload)
                return index[workload]

            for line in new_w:
                at(line)
            records += [_with_index(line, at(staged_w[_record_index(line)])) for line in new_r]
            _write_lines(self.work_dir, workloads, records)
        self.merged_workloads, self.merged_records = len(staged_w), len(staged_r)
        return len(new_r)


@contextlib.contextmanager
def staged(work_dir: str) -> Iterator[Staging]:
    """Tune into a staged copy of ``work_dir``'s database; what was measured is merged on the
    way out, also when the run is interrupted (the caller merges after each stage too)."""
    stage_dir = tempfile.mkdtemp(prefix="souffle_tune_")
    try:
        stage = Staging(work_dir, stage_dir)
        try:
            yield stage
        except BaseException:
            with contextlib.suppress(Exception):
                stage.merge()
            raise
        stage.merge()
    finally:
        shutil.rmtree(stage_dir, ignore_errors=True)


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
