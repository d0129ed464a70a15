"""Block counts (``cost.tir_counts``) of the replayed plans' kernels: TVM's rebuilt today, souffle's at their commit.

The replayed plans (``data/latency/plans-<commit>.json``, ``souffle_experiments/latency_replay.py``) were
written by old commits that counted nothing per block, so the latency fit never saw a kernel's
K-step chain or its shared-memory wavefronts. TVM's own kernels (``fusion="tvm"``: Relax FuseOps +
dlight) do not depend on this project's code, so this script rebuilds every tvm case of
``plans-44fa44f.json`` today (CUDA sm_90, the case's dtype, no nvcc: the counts come from the
lowered TIR) and takes each plan kernel's ``block_counts`` from today's report kernel of the same
name, only where grid, block and launches are all equal. Every plan kernel without such a match is
listed in ``mismatches`` and gets no counts.

The souffle cases of both plans files were stitched by the old commits' code, so they are rebuilt
by that code (a git worktree first on ``PYTHONPATH``, as ``latency_replay.py`` ran; nvcc on, since
the second build widens the stitched grids from ptxas' figures), each device kernel of the last
build counted by today's ``tir_counts`` (loaded by file path), and written under
``"<case id>@<commit>"`` (both plans files hold cases of the same id).

    .venv/bin/python -m souffle_experiments latency-counts        # writes data/latency/counts-tvm.json
    git worktree add /tmp/old44fa 44fa44f
    PYTHONPATH=/tmp/old44fa .venv/bin/python -P -m souffle_experiments latency-counts --old-commit 44fa44f
    git worktree add /tmp/old8580 8580722
    PYTHONPATH=/tmp/old8580 .venv/bin/python -P -m souffle_experiments latency-counts --old-commit 8580722

``-P`` keeps the working directory off ``sys.path`` (``-m`` would put it first), so the old tree on
``PYTHONPATH`` is the ``souffle_tvm`` imported, from whatever directory. Each run replaces only the
cases it builds. ``souffle_experiments/latency_fit.py`` attaches the counts to the plan rows it fits on.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from .paths import DATA, ROOT

PLANS = DATA / "latency" / "plans-44fa44f.json"
OUT = DATA / "latency" / "counts-tvm.json"
ARCH = "sm_90"


def head() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()


def match(case: dict, report_kernels) -> tuple[dict, list[str]]:
    """{plan kernel name: block counts} for the plan kernels today's build has identically, and a
    line for each one it has not."""
    today = {k.name: k for k in report_kernels}
    counts, mismatches = {}, []
    for k in case["kernels"]:
        t = today.get(k["name"])
        if t is None:
            mismatches.append(f"{case['id']} {k['name']}: no kernel of that name today")
            continue
        planned = {"grid": list(k["grid"]), "block": list(k["block"]), "launches": k["launches"]}
        built = {"grid": list(t.grid), "block": list(t.block), "launches": t.launches}
        diffs = [f"{f} {planned[f]} -> {built[f]} today" for f in planned if planned[f] != built[f]]
        if diffs:
            mismatches.append(f"{case['id']} {k['name']}: " + ", ".join(diffs))
        elif t.block_counts is None:
            mismatches.append(f"{case['id']} {k['name']}: today's kernel has no block counts")
        else:
            counts[k["name"]] = t.block_counts
    return counts, mismatches


def _today_tir_counts():
    """Today's ``cost.tir_counts`` loaded by file path (as package ``today_cost``: ``cost/`` imports
    only itself), beside an old tree's ``souffle_tvm`` first on ``sys.path``."""
    import importlib
    import importlib.util

    cost = ROOT / "souffle_tvm" / "cost"
    spec = importlib.util.spec_from_file_location("today_cost", cost / "__init__.py",
                                                  submodule_search_locations=[str(cost)])
    pkg = importlib.util.module_from_spec(spec)
    sys.modules["today_cost"] = pkg
    spec.loader.exec_module(pkg)
    return importlib.import_module("today_cost.tir_counts")


def old_commit(args) -> int:
    """The souffle cases of ``plans-<commit>.json`` rebuilt by the old tree first on ``sys.path``
    (as ``souffle_experiments/latency_replay.py`` did), each device kernel of the last build counted by
    today's ``tir_counts``; written under ``"<case id>@<commit>"``."""
    import tvm
    from tvm import tirx

    tir_counts = _today_tir_counts()
    import souffle_tvm
    from souffle_tvm import build_tvm, zoo
    from souffle_tvm.api import compile as compile_model

    tree = Path(souffle_tvm.__file__).resolve().parent.parent
    if tree == ROOT:
        raise SystemExit("--old-commit needs the old commit's worktree first on PYTHONPATH")
    counted: dict[str, dict] = {}
    record = build_tvm.record_device_kernels

    @tvm.transform.module_pass(opt_level=0, name="latency_counts.CountDeviceKernels")
    def counting(mod, ctx):
        if build_tvm._recording:
            for gv, func in mod.functions.items():
                if isinstance(func, tirx.PrimFunc) and func.attrs is not None \
                        and "tirx.kernel_launch_params" in func.attrs:
                    counted[gv.name_hint] = tir_counts.block_counts(func).as_dict()
        return record(mod)

    build = build_tvm.build

    def counting_build(*a, **kw):
        counted.clear()     # the last build is the one that ran (grids widened by ptxas)
        return build(*a, **kw)

    build_tvm.record_device_kernels, build_tvm.build = counting, counting_build
    plans = json.loads((DATA / "latency" / f"plans-{args.old_commit}.json").read_text())
    cases = [c for c in plans["cases"] if c["fusion"] == "souffle" and (not args.cases or c["id"] in args.cases)]
    out_path = Path(args.out)
    out = json.loads(out_path.read_text())
    for case in cases:
        key = f"{case['id']}@{args.old_commit}"
        t0 = time.perf_counter()
        print(f"{key} ({case['dtype']}, {len(case['kernels'])} plan kernels) ...", flush=True)
        c = compile_model(case["model"], "cuda", "souffle", arch=ARCH, small=case["size"] == "small",
                          dtype=zoo.MODELS[case["model"]].paper_dtype, level="v3")
        kernels = [SimpleNamespace(name=k.name, grid=k.grid, block=k.block, launches=k.launches,
                                   block_counts=counted.get(k.name)) for k in c.report.kernels]
        counts, mismatches = match(dict(case, id=key), kernels)
        out = json.loads(out_path.read_text())     # today's tvm cases may have been rewritten meanwhile
        out["cases"][key] = counts
        out["mismatches"] = [m for m in out["mismatches"] if m.split(" ", 1)[0] != key] + mismatches
        out_path.write_text(json.dumps(out, indent=1) + "\n")
        print(f"    {len(counts)}/{len(case['kernels'])} kernels matched, "
              f"k_steps {sum(v['k_steps'] for v in counts.values())}, "
              f"pipelined {sum(v['pipelined_steps'] for v in counts.values())}"
              f"  [{time.perf_counter() - t0:.0f} s]", flush=True)
        for m in mismatches:
            print(f"      {m}", flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plans", default=str(PLANS))
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--cases", nargs="+", help="only these case ids (the others already in --out are kept)")
    ap.add_argument("--nvcc", action="store_true", help="compile with nvcc too (not needed for the counts)")
    ap.add_argument("--old-commit", help="count the souffle cases of plans-<commit>.json instead, rebuilt by "
                    "that commit's tree (a git worktree first on PYTHONPATH; nvcc as the measured build had)")
    args = ap.parse_args(argv)
    if args.old_commit:
        return old_commit(args)

    from souffle_tvm.pipeline.driver import compile as compile_model

    cases = [c for c in json.loads(Path(args.plans).read_text())["cases"] if c["fusion"] == "tvm"]
    if args.cases:
        unknown = set(args.cases) - {c["id"] for c in cases}
        if unknown:
            raise SystemExit(f"not tvm cases of {args.plans}: {sorted(unknown)}")
        cases = [c for c in cases if c["id"] in args.cases]
    out_path = Path(args.out)
    out = {"built_at": head(), "arch": ARCH, "cases": {}, "mismatches": []}
    if out_path.exists():     # keep the cases this run does not build
        old = json.loads(out_path.read_text())
        redo = {c["id"] for c in cases}
        out["cases"] = {k: v for k, v in old["cases"].items() if k not in redo}
        out["mismatches"] = [m for m in old["mismatches"] if m.split(" ", 1)[0] not in redo]
    for case in cases:
        t0 = time.perf_counter()
        print(f"{case['id']} ({case['dtype']}, {len(case['kernels'])} plan kernels) ...", flush=True)
        try:
            c = compile_model(case["model"], "cuda", "tvm", arch=ARCH, small=case["size"] == "small",
                              dtype=case["dtype"], nvcc=args.nvcc)
        except Exception as err:  # noqa: BLE001 - one case's failure is recorded, the rest still run
            first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
            out["mismatches"] += [f"{case['id']} {k['name']}: build failed today ({type(err).__name__}: {first})"
                                  for k in case["kernels"]]
            print(f"    build failed: {type(err).__name__}: {first}", flush=True)
            continue
        counts, mismatches = match(case, c.report.kernels)
        extra = sorted({k.name for k in c.report.kernels} - {k["name"] for k in case["kernels"]})
        out["cases"][case["id"]] = counts
        out["mismatches"] += mismatches
        k_steps = sum(v["k_steps"] for v in counts.values())
        piped = sum(v["pipelined_steps"] for v in counts.values())
        print(f"    {len(counts)}/{len(case['kernels'])} kernels matched, k_steps {k_steps}, pipelined {piped}"
              + (f", {len(mismatches)} mismatched" if mismatches else "")
              + (f", only today: {extra}" if extra else "") + f"  [{time.perf_counter() - t0:.0f} s]", flush=True)
        for m in mismatches:
            print(f"      {m}", flush=True)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(out, indent=1) + "\n")
    out_path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {out_path}: {sum(map(len, out['cases'].values()))} kernels with counts, "
          f"{len(out['mismatches'])} mismatches", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
