"""Default vs MetaSchedule-tuned Souffle stages on the CPU (llvm): per stage and end to end.

Tunes the model's distinct v2 stages into a database (``souffle_tvm.tune``; skipped for
stages the database already holds), then, in this one process, times each stage's PrimFunc
as the default path builds it on llvm (the plain loop nest: the dlight rules are CUDA-only)
and as the database schedules it, and the whole model compiled without and with
``database=``. Figures are medians of repeated runs on this machine's CPU: they say what
tuning does on a CPU, nothing about a GPU.

    .venv/bin/python -m souffle_experiments bench-tune bert --small --trials 32 --database /tmp/bert-db
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import numpy as np
import tvm
from tvm import relax, tirx

from souffle_tvm import tune
from souffle_tvm.codegen import database
from souffle_tvm.runtime import runner
from souffle_tvm.pipeline.driver import compile as compile_model
from souffle_tvm.frontend.importer import import_onnx
from souffle_tvm.core.targets import make_target


def _random_args(func: tirx.PrimFunc, dev) -> list:
    rng = np.random.default_rng(0)
    return [tvm.runtime.tensor(rng.standard_normal([int(d) for d in p.ty.shape]).astype(str(p.ty.dtype)), dev)
            for p in func.params]


def time_func(func: tirx.PrimFunc, target, repeat: int, min_ms: int = 50) -> float:
    """Median seconds of one call of ``func`` (each of ``repeat`` samples runs >= ``min_ms``)."""
    func = func.with_attr("global_symbol", "main")
    ex = tvm.compile(tvm.IRModule({"main": func}), target)
    dev = tvm.cpu()
    timer = ex.mod.time_evaluator("main", dev, number=1, repeat=repeat, min_repeat_ms=min_ms)
    return statistics.median(timer(*_random_args(func, dev)).results)


def time_model(compiled, repeat: int, min_ms: int = 50) -> float:
    """Median seconds of one inference through Relax's VM (VM and arguments made once)."""
    feeds = runner.random_inputs(compiled.model.inputs, 0)
    ordered = runner.check_feeds(compiled.model.inputs, feeds)
    dev = tvm.cpu()
    vm = relax.VirtualMachine(compiled.executable, dev)
    args = [tvm.runtime.tensor(a, dev) for a in [*ordered, *compiled.model.params]]
    timer = vm.time_evaluator("main", dev, number=1, repeat=repeat, min_repeat_ms=min_ms)
    return statistics.median(timer(*args).results)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--trials", type=int, default=32)
    ap.add_argument("--database", required=True)
    ap.add_argument("--max-stages", type=int, default=None)
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--no-tune", action="store_true", help="time what the database holds, tune nothing")
    ap.add_argument("--no-model", action="store_true", help="stages only (full-size models run for seconds on llvm)")
    ap.add_argument("--out", default=None, help="JSON results (default results/tune-<model>-llvm-<date>.json)")
    args = ap.parse_args(argv)
    target = make_target("llvm")
    imported = import_onnx(args.model, None, small=args.small)
    tasks = tune.extract_tasks(imported.mod, target, imported.params, "v2")[: args.max_stages]
    todo = []
    if os.path.exists(os.path.join(args.database, database.RECORDS)):
        db = database.open_database(args.database)
        todo = [t for t in tasks if not database.known(db, t.func)]     # tuned (or tried) before: kept
    else:
        todo = tasks
    t0 = time.perf_counter()
    results = []
    if todo and not args.no_tune:
        results = tune.tune_tasks(todo, target, args.database, args.trials, tune.make_runner(target, None, None),
                                   level="v2")
    tune_seconds = time.perf_counter() - t0
    db = database.open_database(args.database)
    rows = []
    for t in tasks:
        tuned, why = database.lookup(db, t.func, target)
        trials, best = database.measured(db, t.func)
        default_s = time_func(t.func, target, args.repeat)
        tuned_s = time_func(tuned, target, args.repeat) if tuned is not None else None
        rows.append({"stage": t.name, "calls": t.calls, "trials": trials, "default_us": default_s * 1e6,
                     "tuned_us": tuned_s * 1e6 if tuned_s else None, "ms_best_us": best * 1e6 if best else None,
                     "speedup": default_s / tuned_s if tuned_s else None, "note": why})
        print(f"{t.name:<28} x{t.calls}  default {default_s * 1e6:10.1f} us  tuned "
              f"{(tuned_s or float('nan')) * 1e6:9.1f} us  ({rows[-1]['speedup'] or float('nan'):.1f}x, {trials} trials)")
    e2e = None
    if not args.no_model:
        plain = compile_model(imported, "llvm", "souffle")
        with_db = compile_model(imported, "llvm", "souffle", database=args.database)
        from_db = sum(1 for k in with_db.report.kernels if k.schedule == "database")
        e2e = {"default_ms": time_model(plain, args.repeat) * 1e3,
               "tuned_ms": time_model(with_db, args.repeat) * 1e3,
               "kernels_from_database": from_db, "kernels": len(with_db.report.kernels)}
        print(f"whole model (v2, llvm VM): default {e2e['default_ms']:.3f} ms, with the database "
              f"{e2e['tuned_ms']:.3f} ms ({from_db} of {e2e['kernels']} kernels tuned)")
    out = args.out or os.path.join("results", f"tune-{imported.name}-llvm-{datetime.date.today()}.json")
    tuned_seconds = {r.name: round(r.seconds, 1) for r in results}
    with open(out, "w") as f:
        json.dump({"model": imported.name, "target": "llvm (this machine's CPU)", "cores": os.cpu_count(),
                   "trials_per_stage": args.trials, "tune_seconds": round(tune_seconds, 1),
                   "records": database.record_count(args.database), "repeat": args.repeat,
                   "tune_seconds_per_stage": tuned_seconds, "stages": rows, "whole_model": e2e}, f, indent=1)
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
