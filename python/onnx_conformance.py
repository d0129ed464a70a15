"""ONNX's conformance suite (``onnx.backend.test.BackendTest``) against souffle-tvm, both fusions, llvm.

    python python/onnx_conformance.py                      # everything: results/onnx-conformance-<date>.{md,json}
    python python/onnx_conformance.py --only 'test_relu|test_add' --fusions tvm --no-write

Every test of BackendTest on the CPU device: the node tests it makes from the cases the onnx
package ships, and its model tests ("real" = the package's local light models, "simple",
"pytorch-converted", "pytorch-operator"); nothing is downloaded. Each test runs in a worker
process (one at a time), so a test that kills its process (a segfault) or runs past
``--timeout`` seconds is recorded as a crash and the next test gets a fresh worker.

Outcomes (``souffle_tvm.pipeline.onnx_backend.classify``): pass, unsupported (the project's clear
error, with its message), wrong (outputs differ from ONNX's), crash (anything else), skip.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import re
import sys
import tempfile
import time
from collections import Counter, defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FUSIONS = ("tvm", "souffle")
KINDS = ("node", "real", "simple", "pytorch-converted", "pytorch-operator")


def _worker(conn) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    from souffle_tvm.pipeline import onnx_backend

    tests = {}
    while True:
        job = conn.recv()
        if job is None:
            return
        fusion, name = job
        if fusion not in tests:
            tests[fusion] = onnx_backend.conformance_tests(fusion)
        t = time.perf_counter()
        outcome, message = onnx_backend.run_conformance_test(tests[fusion][name])
        conn.send((outcome, message, round(time.perf_counter() - t, 2)))


class Worker:
    """One worker process; restarted after a test that killed it or ran too long."""

    def __init__(self):
        self.proc = None

    def run(self, fusion: str, name: str, timeout: float) -> tuple[str, str, float]:
        if self.proc is None or not self.proc.is_alive():
            ctx = mp.get_context("spawn")
            self.conn, child = ctx.Pipe()
            self.proc = ctx.Process(target=_worker, args=(child,), daemon=True)
            self.proc.start()
            self.first = True
        t = time.perf_counter()
        self.conn.send((fusion, name))
        # the first test of a fresh worker also pays its imports and BackendTest's set-up
        limit = timeout + (120 if self.first else 0)
        self.first = False
        if self.conn.poll(limit):
            try:
                return self.conn.recv()
            except EOFError:
                pass
            code = self.proc.exitcode
            self.close()
            return "crash", f"the worker process died (exit code {code})", round(time.perf_counter() - t, 2)
        self.close()
        return "crash", f"timed out after {timeout:.0f} s", round(time.perf_counter() - t, 2)

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.is_alive():
                self.proc.kill()
            self.proc.join(10)
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            try:
                self.conn.send(None)
                self.proc.join(30)
            except (BrokenPipeError, OSError):
                pass
        self.close()


def test_ops() -> dict[str, dict]:
    """Per test (BackendTest's CPU name): its kind and the ONNX op types its model uses."""
    import onnx
    from onnx.backend.test.loader import load_model_tests

    out = {}
    for kind in KINDS:
        for case in load_model_tests(kind=kind):
            model = case.model
            if model is None:
                path = os.path.join(case.model_dir, "model.onnx") if case.model_dir else \
                    os.path.join(os.path.dirname(os.path.dirname(onnx.__file__)), case.url)
                model = onnx.load(path, load_external_data=False)
            ops = [n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}::{n.op_type}" for n in model.graph.node]
            out[f"{case.name}_cpu"] = {"kind": kind, "ops": sorted(set(ops)), "single": ops[0] if len(ops) == 1 else None}
    return out


def op_table(results: dict, meta: dict, fusions: list[str]) -> dict[str, dict]:
    """Per op: its single-node node tests (the op's own tests) and how many pass per fusion."""
    table = defaultdict(lambda: {"tests": 0, **{f: Counter() for f in fusions}})
    for name, info in meta.items():
        op = info["single"]
        if info["kind"] != "node" or op is None or name not in results:
            continue
        row = table[op]
        row["tests"] += 1
        for f in fusions:
            if f in results[name]:
                row[f][results[name][f]["outcome"]] += 1
    return dict(sorted(table.items()))


def write(results: dict, meta: dict, fusions: list[str], stem: str, note: str, seconds: dict) -> None:
    totals = {f: Counter(r[f]["outcome"] for r in results.values() if f in r) for f in fusions}
    ops = op_table(results, meta, fusions)
    with open(stem + ".json", "w") as f:
        json.dump({"fusions": fusions, "note": note, "totals": totals, "seconds": seconds,
                   "ops": {op: {"tests": r["tests"], **{fu: dict(r[fu]) for fu in fusions}} for op, r in ops.items()},
                   "tests": {n: {**r, "kind": meta.get(n, {}).get("kind"), "ops": meta.get(n, {}).get("ops")}
                             for n, r in sorted(results.items())}}, f, indent=1)
    kinds = ["pass", "unsupported", "wrong", "crash", "skip"]
    lines = [f"# ONNX backend conformance: souffle-tvm on llvm ({datetime.date.today()})", "",
             "`python python/onnx_conformance.py` runs `onnx.backend.test.BackendTest` (onnx "
             f"{_onnx_version()}) over `souffle_tvm.pipeline.onnx_backend` on the CPU device: the node tests "
             "made from the cases the onnx package ships and the model tests it ships (real = its local "
             "light models, simple, pytorch-converted, pytorch-operator; nothing downloaded), each "
             "compiled for llvm with `fusion=\"tvm\"` and `fusion=\"souffle\"` (level v2). "
             "pass: outputs equal ONNX's within the test's tolerance; unsupported: the project "
             "refused the model with its clear error (`UnsupportedOperatorError`, `DynamicShapeError`, "
             "`ModelLoadError`), message below; wrong: outputs differ; crash: any other error, a hang "
             "or a dead process.", ""]
    if note:
        lines += [note, ""]
    lines += ["| fusion | tests | " + " | ".join(kinds) + " | seconds |", "| --- | --- |" + " --- |" * (len(kinds) + 1)]
    for f in fusions:
        lines.append(f"| {f} | {sum(totals[f].values())} | " + " | ".join(str(totals[f][k]) for k in kinds)
                     + f" | {seconds.get(f, 0):.0f} |")
    lines += ["", "## Per op (node tests whose graph is that one op)", "",
              "| op | tests | " + " | ".join(f"{f} pass" for f in fusions) + " |",
              "| --- | --- |" + " --- |" * len(fusions)]
    for op, r in ops.items():
        lines.append(f"| {op} | {r['tests']} | " + " | ".join(str(r[f]["pass"]) for f in fusions) + " |")
    lines += ["", "## Per test", "", "| test | " + " | ".join(fusions) + " |", "| --- |" + " --- |" * len(fusions)]
    for name, r in sorted(results.items()):
        cells = []
        for f in fusions:
            if f not in r:
                cells.append("not run")
                continue
            o, m = r[f]["outcome"], r[f]["message"]
            cells.append(o if o == "pass" else f"{o}: {m[:160]}".replace("|", "\\|").replace("\n", " "))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")


def _onnx_version() -> str:
    import onnx

    return onnx.__version__


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fusions", nargs="+", default=list(FUSIONS), choices=FUSIONS)
    ap.add_argument("--only", help="regular expression: run the tests whose name it matches (re.search)")
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS, help="which of BackendTest's kinds")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per test before it counts as a crash")
    ap.add_argument("--real-timeout", type=float, default=1200.0,
                    help="the same for the 'real' models (whole CNNs: minutes each with --fusion souffle on 2 cores)")
    ap.add_argument("--out", default=os.path.join(ROOT, "results", f"onnx-conformance-{datetime.date.today()}"),
                    help="path stem of the .md and .json written")
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args(argv)
    os.environ.setdefault("ONNX_HOME", os.path.join(tempfile.gettempdir(), "souffle-tvm-onnx-home"))
    import warnings

    warnings.filterwarnings("ignore")
    meta = test_ops()
    names = sorted(n for n in meta if meta[n]["kind"] in args.kinds and (not args.only or re.search(args.only, n)))
    results: dict[str, dict] = defaultdict(dict)
    seconds = {}
    worker = Worker()
    try:
        for fusion in args.fusions:
            t0, counts = time.perf_counter(), Counter()
            for i, name in enumerate(names):
                limit = args.real_timeout if meta[name]["kind"] == "real" else args.timeout
                outcome, message, secs = worker.run(fusion, name, limit)
                results[name][fusion] = {"outcome": outcome, "message": message, "seconds": secs}
                counts[outcome] += 1
                if outcome in ("wrong", "crash") or (i + 1) % 50 == 0 or i + 1 == len(names):
                    print(f"[{fusion} {i + 1}/{len(names)} {time.perf_counter() - t0:.0f}s {dict(counts)}] "
                          f"{name}: {outcome} {message[:200]}", flush=True)
            seconds[fusion] = time.perf_counter() - t0
    finally:
        worker.stop()
    for f in args.fusions:
        print(f, dict(Counter(r[f]["outcome"] for r in results.values() if f in r)))
    if not args.no_write:
        write(results, meta, args.fusions, args.out, "", seconds)
        print(f"wrote {args.out}.md and .json")
    bad = sum(1 for r in results.values() for v in r.values() if v["outcome"] in ("wrong", "crash"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
