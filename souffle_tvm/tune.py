"""``souffle-tvm tune``: MetaSchedule per Souffle stage, into a JSON database later compiles reuse.

The tasks are the group PrimFuncs the Souffle pipeline emits (v2: one kernel each; v3: the
stages one cooperative kernel stitches), *unscheduled*, exactly as the scheduler sees them, so
a record found again at compile time (``database.lookup``) matches by structural hash.
Structurally identical groups (BERT's twelve layers) are one task. Each task is tuned by
MetaSchedule's own machinery (``tune_tasks``: post-order-apply design space, evolutionary
search, the XGBoost cost model shared across tasks, a ``JSONDatabase`` in the work dir).

Measuring: on llvm the CPU here; on CUDA a local GPU, or remote GPUs behind an RPC tracker
(MetaSchedule's ``RPCRunner``). With neither, tuning stops with a :class:`TuningError`
before anything slow starts.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import tvm
import tvm_ffi
from tvm import tirx

from .build.executable import primfunc_calls
from .codegen import database as db
from .pipeline import results
from .pipeline.options import AUTO, Options
from .errors import MeasureError, TuningError
from .measure import device
from .core.targets import describe, is_cuda


@dataclass
class Task:
    """One distinct group PrimFunc to tune."""

    name: str                  # the emitted function's name (the first group using it)
    func: tirx.PrimFunc        # unscheduled, as the pipeline's scheduler receives it
    calls: int = 1             # how many groups of the model call it


@dataclass
class TaskResult:
    name: str
    calls: int
    trials: int                # measured candidates in the database for this task
    best_seconds: float | None  # the best measured mean run time (None: nothing ran)
    seconds: float             # wall time spent tuning it
    error: str | None = None   # MetaSchedule failed on it: the stage keeps the default rules


@dataclass
class TuneSummary:
    model: str
    target: str
    level: str
    database: str
    tasks: list[TaskResult] = field(default_factory=list)
    records: int = 0           # tuning records in the database afterwards
    seconds: float = 0.0


def extract_tasks(mod: tvm.IRModule, target: tvm.target.Target, params: list, level: str = AUTO) -> list[Task]:
    """The distinct group PrimFuncs the Souffle pipeline emits for this model, unscheduled.

    v2 and v3 differ: v3 also splits GEMM-fed reductions in two phases, so its groups (the
    stages it stitches) are not v2's; ``auto`` (the default, as ``compile``'s) is v3 with the
    time-driven partitioner, which splits only where the latency model predicts it pays. The
    pipeline runs once with the default schedules; only its unscheduled twin is kept.
    """
    result = results.run(mod, target, params, Options(level=level))
    calls = primfunc_calls(result.unscheduled)
    tasks: list[Task] = []
    seen: dict[int, list[Task]] = {}
    for gv, func in result.unscheduled.functions.items():
        if not isinstance(func, tirx.PrimFunc):
            continue
        bucket = seen.setdefault(tvm_ffi.structural_hash(func), [])
        same = next((t for t in bucket if tvm_ffi.structural_equal(t.func, func)), None)
        if same is not None:      # BlockBuilder already merges most; this catches the rest
            same.calls += calls.get(gv.name_hint, 1)
            continue
        task = Task(gv.name_hint, func, calls.get(gv.name_hint, 1))
        bucket.append(task)
        tasks.append(task)
    return tasks


# -- measuring ----------------------------------------------------------------------------------
def parse_tracker(text: str) -> tuple[str, int]:
    try:
        return device.parse_tracker(text)
    except MeasureError as err:
        raise TuningError(str(err)) from None


TRACKER_TIMEOUT_S = device.TRACKER_TIMEOUT_S


def check_tracker(host: str, port: int, key: str, timeout: float = TRACKER_TIMEOUT_S) -> int:
    """``measure.device.check_tracker``, its failures as a TuningError."""
    try:
        return device.check_tracker(host, port, key, timeout)
    except MeasureError as err:
        raise TuningError(str(err)) from None


def cuda_available() -> bool:
    """A local CUDA device TVM can run on (TVM built with CUDA, and a device 0)."""
    return tvm.runtime.enabled("cuda") and tvm.cuda(0).exist


def make_runner(target: tvm.target.Target, rpc_tracker: str | None, rpc_key: str | None,
                timeout_s: float = 30.0):
    """MetaSchedule's runner for where the candidates can run, or a TuningError saying why none."""
    from tvm.s_tir import meta_schedule as ms

    evaluator = ms.runner.EvaluatorConfig(number=3, repeat=1, min_repeat_ms=0, enable_cpu_cache_flush=False)
    if rpc_tracker or rpc_key:
        if not (rpc_tracker and rpc_key):
            raise TuningError("--rpc-tracker and --rpc-key go together")
        host, port = parse_tracker(rpc_tracker)
        free = check_tracker(host, port, rpc_key)
        # RPCRunner takes no timeout of its own: RPCConfig's session_timeout_sec bounds both
        # reaching the tracker and each candidate's run (RPCRunnerFuture gives up after it).
        # One connection per server free now (RPCRunner's default is one in all).
        return ms.runner.RPCRunner(ms.runner.RPCConfig(tracker_host=host, tracker_port=port, tracker_key=rpc_key,
                                                       session_timeout_sec=int(timeout_s)),
                                   evaluator_config=evaluator, max_workers=max(1, free))
    if is_cuda(target) and not cuda_available():
        raise TuningError("tuning for CUDA measures every candidate on a GPU: this machine has none "
                          f"(TVM CUDA runtime {'present' if tvm.runtime.enabled('cuda') else 'absent'}). "
                          "Run it where a GPU is, or give --rpc-tracker HOST:PORT --rpc-key KEY "
                          "(TVM's RPC tracker with GPU servers), or tune --target llvm")
    return ms.runner.LocalRunner(timeout_sec=timeout_s, evaluator_config=evaluator)


def _in_process_builder():
    """MetaSchedule's own build and export, in this process: its LocalBuilder starts fresh
    worker processes for every batch, and each imports all of ``tvm.s_tir.tensor_intrin`` (20-50 s
    on this 2-core machine) before building anything."""
    from tvm.ir.utils import derived_object
    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.meta_schedule.builder.local_builder import default_build, default_export

    @derived_object
    class InProcessBuilder(ms.builder.PyBuilder):
        def build(self, build_inputs):
            out = []
            for inp in build_inputs:
                try:
                    # default_export writes each artifact into its own mkdtemp(), which
                    # MetaSchedule's RemoveBuildArtifact callback deletes after the run.
                    out.append(ms.builder.BuilderResult(default_export(default_build(inp.mod, inp.target, None)), None))
                except Exception as err:  # noqa: BLE001 - a candidate that fails to build is a failed trial
                    out.append(ms.builder.BuilderResult(None, f"{type(err).__name__}: {err}"))
            return out

    return InProcessBuilder()


# -- tuning -------------------------------------------------------------------------------------
TUNE_LEVELS = (AUTO, "v2", "v3")     # auto: compile's default level, as it resolves for the target


def tuning_target(target: tvm.target.Target, level: str = AUTO) -> tvm.target.Target:
    """The target MetaSchedule searches for. CPU: with ``num-cores`` (its CPU rules require it;
    this machine's count). CUDA at v3 (and auto, which is v3): at most the stitched kernel's
    block size of threads, so fewer tuned stages are refused at compile time for another block size."""
    attrs = {k: v for k, v in target.attrs.items() if k != "keys"}
    if is_cuda(target):
        if Options(level=level).resolved().level != "v3":
            return target
        from .core.geometry import STITCH_BLOCK

        attrs.update({"max_num_threads": STITCH_BLOCK, "max_threads_per_block": STITCH_BLOCK})
    elif "num-cores" not in attrs:
        attrs["num-cores"] = os.cpu_count() or 1
    return tvm.target.Target({**attrs, "kind": target.kind.name})


def tune_tasks(tasks: list[Task], target: tvm.target.Target, work_dir: str, trials: int,
               runner, log: Callable[[str], None] = print, seed: int = 0, level: str = "v2") -> list[TaskResult]:
    """Tune each task for ``trials`` measured candidates into the JSON database in ``work_dir``.

    One MetaSchedule ``tune_tasks`` call per task, so progress is reported per task; the
    XGBoost cost model and the database are shared by all of them. MetaSchedule writes into
    a staged copy of the database; each task's records are merged into ``work_dir``
    atomically when it ends (``codegen.database.staged``), so an interrupted run keeps the
    tasks it finished and never leaves a cut line behind.
    """
    from tvm.s_tir import meta_schedule as ms

    os.makedirs(work_dir, exist_ok=True)
    target = tuning_target(target, level)
    db.register_tensor_intrinsics(target)      # before MetaSchedule imports every target's (30 s)
    per_iter = min(trials, 16)
    cost_model = ms.cost_model.XGBModel(num_warmup_samples=min(100, max(per_iter, trials // 2)),
                                        num_tuning_cores=max(os.cpu_count() or 1, 1))
    builder = _in_process_builder()
    ms_logger = logging.getLogger("tvm.s_tir.meta_schedule")
    quiet = ms_logger.level == logging.NOTSET     # unless the caller set a level: logs to files only
    results = []
    with db.staged(work_dir) as stage:
        for i, task in enumerate(tasks, 1):
            if quiet:    # MetaSchedule sizes its console handler from this level each time it configures logging
                ms_logger.setLevel(logging.WARNING)
            t0 = time.perf_counter()
            log(f"[{i}/{len(tasks)}] {task.name} (called {task.calls}x): tuning {trials} trials ...")
            ctx = ms.TuneContext(mod=task.func, target=target, space_generator="post-order-apply",
                                 search_strategy=ms.search_strategy.EvolutionarySearch(
                                     population_size=max(32, 4 * per_iter), init_min_unmeasured=per_iter,
                                     genetic_num_iters=2),
                                 task_name=task.name, rand_state=seed + i, num_threads=max(os.cpu_count() or 1, 1),
                                 logger=ms.logging.get_loggers_from_work_dir(work_dir, [task.name])[0]).clone()
            error = None
            try:
                ms.tune.tune_tasks(tasks=[ctx], task_weights=[1.0], work_dir=work_dir, max_trials_global=trials,
                                   num_trials_per_iter=per_iter, builder=builder, runner=runner,
                                   database=stage.database, cost_model=cost_model, task_scheduler="round-robin")
            except Exception as err:  # noqa: BLE001 - one stage MetaSchedule cannot handle must not stop the rest
                # (seen: a ScheduleError in reverse-compute-at on a LayerNorm group; see docs/tuning.md)
                lines = [ln for ln in str(err).strip().splitlines() if ln.strip()]
                error = f"{type(err).__name__}: {lines[0] if lines else ''}"[:300]
                if len(lines) > 1:
                    error += f" ... {lines[-1][:200]}"
            stage.merge()
            measured, best = db.measured(stage.database, task.func)
            res = TaskResult(task.name, task.calls, measured, best, time.perf_counter() - t0, error)
            results.append(res)
            shown = f"best {best * 1e6:.2f} us" if best is not None else "no candidate ran"
            if error:
                shown += f"; MetaSchedule failed, the stage keeps the default rules ({error})"
            log(f"[{i}/{len(tasks)}] {task.name}: {measured} trials measured, {shown} ({res.seconds:.1f} s)")
    return results


def tune(model, target: tvm.target.Target, database_dir: str, trials: int, *, level: str = AUTO,
         small: bool = False, dtype: str = "float32", shapes: dict | None = None, bind: dict | None = None,
         rpc_tracker: str | None = None, rpc_key: str | None = None, max_tasks: int | None = None,
         log: Callable[[str], None] = print) -> TuneSummary:
    """Tune every distinct Souffle stage of ``model`` for ``target``; the records go to
    ``database_dir`` (``souffle_tvm.compile(..., database=database_dir)`` applies them).

    ``level``: whose stages, v2's or v3's; ``auto`` (the default) those of the level ``compile``
    builds by default for this target (``Options.resolved``: v3, time-driven).
    ``max_tasks`` tunes only the first N distinct stages (the rest keep the default rules)."""
    from .frontend.importer import ImportedModel, import_onnx

    if trials < 1:
        raise TuningError(f"--trials must be at least 1 (got {trials})")
    if level not in TUNE_LEVELS:
        raise TuningError(f"tuning follows the auto, v2 or v3 groups (got level {level!r})")
    t0 = time.perf_counter()
    runner = make_runner(target, rpc_tracker, rpc_key)     # first: a missing GPU stops us at once
    imported = model if isinstance(model, ImportedModel) else import_onnx(model, shapes, small=small, dtype=dtype,
                                                                          bind=bind)
    tasks = extract_tasks(imported.mod, target, imported.params, level)
    level = Options(level=level).check(target).level      # auto as the level it stands for
    log(f"{imported.name}: {len(tasks)} distinct stages ({sum(t.calls for t in tasks)} group calls) at {level}, "
        f"target {describe(target)}, {trials} trials each, database {database_dir}")
    if max_tasks is not None:
        tasks = tasks[:max_tasks]
    results = tune_tasks(tasks, target, database_dir, trials, runner, log, level=level)
    summary = TuneSummary(imported.name, describe(target), level, database_dir, results,
                          db.record_count(database_dir), time.perf_counter() - t0)
    log(f"done in {summary.seconds:.1f} s: {summary.records} records in {database_dir}")
    return summary
