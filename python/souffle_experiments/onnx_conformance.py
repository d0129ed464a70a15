"""ONNX's conformance suite (``onnx.backend.test.BackendTest``) against souffle-tvm, both fusions, llvm.

    python -m souffle_experiments conformance                      # everything: results/onnx-conformance-<date>.{md,json}
    python -m souffle_experiments conformance --only 'test_relu|test_add' --fusions tvm --no-write

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

from . import paths

ROOT = str(paths.ROOT)
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
             "`python -m souffle_experiments conformance` runs `onnx.backend.test.BackendTest` (onnx "
             f"{_onnx_version()}) over `souffle_tvm.pipeline.onnx_backend` on the CPU device: the node tests "
             "made from the cases the onnx package ships and the model tests it ships (real = its local "
             "light models, simple, pytorch-converted, pytorch-operator; nothing downloaded), each "
             "compiled for llvm with `fusion=\"tvm\"` and `fusion=\"souffle\"` (level v2). "
             "pass: outputs equal ONNX's within the test's tolerance; unsupported: the project "
             "refused the model with its clear error (`UnsupportedOperatorError`, `DynamicShapeError`, "
             "`ModelLoadError`), message below; wrong: outputs differ; crash: any other error, a hang "
             "or a dead process. The backend imports with `fp16_accumulation=\"float32\"`: float16 "
             "MatMul/Gemm/Conv/reductions accumulate in float32 and float16 Softmax sums in float32, as "
             "ONNX's reference (numpy) does; `souffle_tvm.compile` keeps float16 by default.", ""]
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


README_BEGIN = "<!-- onnx-conformance: written by python -m souffle_experiments conformance --readme -->"
README_END = "<!-- /onnx-conformance -->"


def reason_kind(message: str) -> str:
    """A refusal's kind, for the README's op list."""
    if "unsupported ONNX operator" in message:
        return "no converter"
    if "unsupported element type" in message:
        return "an input data type TVM lacks (strings, float8, bfloat16, uint16/32/64, ...)"
    if "DynamicShapeError" in message:
        return "an input that must be a constant at compile time (axes, shapes, sizes given as run-time inputs)"
    if "unsupported form of" in message:
        return "an attribute form refused (the message names it)"
    if "TVM's ONNX importer failed" in message:
        return "TVM's importer fails on the node"
    return "other (sequences, optionals, untyped outputs)"


def readme_section(table: dict, md_path: str) -> str:
    """The README's supported-op list, from a conformance JSON (``table``)."""
    fusions = table["fusions"]
    why: dict[str, Counter] = defaultdict(Counter)   # op -> refusal kinds of its own tests
    for t in table["tests"].values():
        ops = t.get("ops") or []
        if t.get("kind") == "node" and len(ops) == 1 and t[fusions[0]]["outcome"] == "unsupported":
            why[ops[0]][reason_kind(t[fusions[0]]["message"])] += 1
    full, partial, none = [], [], defaultdict(list)
    for op, r in table["ops"].items():
        passed = min(r.get(f, {}).get("pass", 0) for f in fusions)
        if passed == r["tests"]:
            full.append(op)
        elif passed:
            partial.append(f"{op} ({passed}/{r['tests']})")
        else:
            none[why[op].most_common(1)[0][0] if why[op] else "other"].append(op)
    totals = "; ".join(f"`{f}` " + ", ".join(f"{table['totals'][f].get(k, 0)} {k}" for k in
                                             ("pass", "unsupported", "wrong", "crash")) for f in fusions)
    return "\n".join([
        README_BEGIN,
        f"ONNX's own conformance suite (`onnx.backend.test.BackendTest`, {sum(table['totals'][fusions[0]].values())} "
        f"tests: node tests and the model tests the onnx package ships) runs against `souffle_tvm.pipeline.onnx_backend` "
        f"on llvm: {totals}. The table per test, with every refusal's message: `{md_path}` "
        "(`python -m souffle_experiments conformance`; a quick subset is in `make test`, all of it in `make test-all`).",
        "",
        f"* **every test passes** (both fusions, the op's own node tests): {', '.join(full)}",
        f"* **some pass** (passed/tests; the others refused with a clear error: an attribute form, a "
        f"data type, a run-time axes/shape input): {', '.join(partial)}",
        "* **none pass**, each test refused with a clear error; by the most common reason:",
        *[f"  * {kind}: {', '.join(ops)}" for kind, ops in sorted(none.items())],
        README_END])


def write_readme(json_path: str, readme: str) -> None:
    with open(json_path) as f:
        table = json.load(f)
    md = os.path.relpath(os.path.splitext(json_path)[0] + ".md", os.path.dirname(os.path.abspath(readme)))
    with open(readme) as f:
        text = f.read()
    section = readme_section(table, md)
    if README_BEGIN in text:
        head, rest = text.split(README_BEGIN, 1)
        text = head + section + rest.split(README_END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n## ONNX conformance\n\n" + section + "\n"
    with open(readme, "w") as f:
        f.write(text)


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
    ap.add_argument("--note", default="", help="a sentence for the table's head (e.g. what was sampled)")
    ap.add_argument("--merge", metavar="JSON", help="start from this table: the tests run now replace their rows")
    ap.add_argument("--readme", metavar="JSON", help="only rewrite README.md's supported-op list from this table")
    args = ap.parse_args(argv)
    if args.readme:
        write_readme(args.readme, os.path.join(ROOT, "README.md"))
        return 0
    os.environ.setdefault("ONNX_HOME", os.path.join(tempfile.gettempdir(), "souffle-tvm-onnx-home"))
    import warnings

    warnings.filterwarnings("ignore")
    meta = test_ops()
    # the whole CNNs ("real") last: minutes each under souffle
    names = sorted((n for n in meta if meta[n]["kind"] in args.kinds and (not args.only or re.search(args.only, n))),
                   key=lambda n: (meta[n]["kind"] == "real", n))
    results: dict[str, dict] = defaultdict(dict)
    seconds = {}
    table_fusions = list(args.fusions)
    if args.merge:
        with open(args.merge) as f:
            earlier = json.load(f)
        table_fusions = [fu for fu in FUSIONS if fu in earlier["fusions"] or fu in args.fusions]
        for name, row in earlier["tests"].items():
            results[name].update({fu: row[fu] for fu in table_fusions if fu in row})
        # the rerun tests' earlier time is replaced by their time now
        seconds = {fu: earlier["seconds"].get(fu, 0.0) - sum(results[n][fu]["seconds"] for n in names
                                                            if fu in results.get(n, {}) and fu in args.fusions)
                   for fu in table_fusions}
        print(f"merging into {args.merge}: {len(names)} tests rerun", flush=True)
    worker = Worker()

    def save(note: str) -> None:
        if not args.no_write:
            write(results, meta, table_fusions, args.out, " ".join(filter(None, [args.note, note])), seconds)

    base = dict(seconds)
    try:
        for fusion in args.fusions:
            t0, counts = time.perf_counter(), Counter()
            for i, name in enumerate(names):
                limit = args.real_timeout if meta[name]["kind"] == "real" else args.timeout
                outcome, message, secs = worker.run(fusion, name, limit)
                results[name][fusion] = {"outcome": outcome, "message": message, "seconds": secs}
                counts[outcome] += 1
                seconds[fusion] = base.get(fusion, 0.0) + time.perf_counter() - t0
                if outcome in ("wrong", "crash") or (i + 1) % 50 == 0 or i + 1 == len(names):
                    print(f"[{fusion} {i + 1}/{len(names)} {seconds[fusion]:.0f}s {dict(counts)}] "
                          f"{name}: {outcome} {message[:200]}", flush=True)
                if (i + 1) % 100 == 0 or meta[name]["kind"] == "real":   # a partial table, should the run be cut
                    save(f"**Partial**: the run was still going ({fusion}: {i + 1} of {len(names)} tests); "
                         "tests marked `not run` were not reached.")
    finally:
        worker.stop()
    for f in table_fusions:
        print(f, dict(Counter(r[f]["outcome"] for r in results.values() if f in r)))
    save("")
    if not args.no_write:
        print(f"wrote {args.out}.md and .json")
    bad = sum(1 for r in results.values() for v in r.values() if v["outcome"] in ("wrong", "crash"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
