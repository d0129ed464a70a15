"""Snapshot what the compiler decides, to show a refactor changed nothing.

For each (model, size, level) it compiles through the public ``souffle_tvm.compile`` (an API
every version of the package has) for CUDA sm_90 and writes one JSON line: the report's
groups, reasons, subprograms and kernels (grid, block, registers, shared memory, spills,
launches, bytes, flops, stages, grid syncs) and the SHA-256 of the CUDA source. Timings are
left out (they differ run to run).

    make snapshot BASE=<commit> [QUICK=1] [ONLY='mmoe/small lstm/full']   # all three steps below

    PYTHONPATH=<worktree of the old commit> python -P -m souffle_experiments snapshot --out before.jsonl
    python -m souffle_experiments snapshot --out after.jsonl             # this tree
    python -m souffle_experiments snapshot --compare before.jsonl after.jsonl

The script is always this tree's; the ``souffle_tvm`` it snapshots is the first on the path (``-P``
keeps the working directory off it). ``--out`` appends.

``--quick`` takes the six small models only (TVM's build, v0-v4 and the default level); the
default adds the six full-size models (TVM's build, v2, v3 and the default level).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import sys
import time

MODELS = ("bert", "resnext", "lstm", "efficientnet", "swin", "mmoe")
# "tvm" is TVM's own build (--fusion tvm); "auto" the default level (v3, time partitioner)
SMALL_LEVELS = ("tvm", "v0", "v1", "v2", "v3", "v4", "auto")
FULL_LEVELS = ("tvm", "v2", "v3", "auto")
VOLATILE = {"compile_seconds", "nvcc"}   # wall times
ADDED: set = set()                         # fields only the newer snapshot has


def cases(quick: bool) -> list[tuple[str, bool, str]]:
    out = [(m, True, lv) for m in MODELS for lv in SMALL_LEVELS]
    if not quick:
        out += [(m, False, lv) for m in MODELS for lv in FULL_LEVELS]
    return out


def snapshot(model: str, small: bool, level: str) -> dict:
    import souffle_tvm

    if level == "tvm":
        c = souffle_tvm.compile(model, "cuda", fusion="tvm", small=small, arch="sm_90")
    else:
        c = souffle_tvm.compile(model, "cuda", fusion="souffle", small=small, level=level, arch="sm_90")
    rep = {k: v for k, v in c.report.to_json().items() if k not in VOLATILE}
    src = c.cuda_source or ""
    return {"case": f"{model}/{'small' if small else 'full'}/{level}", "report": rep,
            "cuda_sha256": hashlib.sha256(src.encode()).hexdigest()}


def _diff(a, b, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            if k not in b:
                out.append(f"{path}.{k}: only in before")
            elif k not in a:
                ADDED.add(f"{path.split('[')[0]}.{k}")    # a new field: listed, not a difference
            else:
                out += _diff(a[k], b[k], f"{path}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _diff(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {str(a)[:160]!r} -> {str(b)[:160]!r}"]


def compare(before: str, after: str) -> int:
    def load(path: str) -> dict:
        with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
            return {r["case"]: r for r in map(json.loads, f)}

    a, b = load(before), load(after)
    bad = missing = 0
    for case in sorted(set(a) | set(b)):
        if case not in a or case not in b:
            print(f"{case}: only in {'after' if case not in a else 'before'}")
            missing += 1
            continue
        diffs = _diff(a[case], b[case])
        print(f"{case}: {'identical' if not diffs else f'{len(diffs)} difference(s)'}")
        for d in diffs[:12]:
            print(f"    {d}")
        bad += bool(diffs)
    if ADDED:
        print(f"fields only in after (new, not compared): {', '.join(sorted(ADDED))}")
    print(f"{len(set(a) & set(b)) - bad} of {len(set(a) & set(b))} cases in both identical"
          + (f"; {missing} in one only" if missing else ""))
    return 1 if bad or missing else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--quick", action="store_true", help="small models only")
    ap.add_argument("--only", nargs="*", help="case prefixes, e.g. lstm/full")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    args = ap.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    import souffle_tvm

    # which tree is snapshotted (make snapshot puts BASE's worktree first on the path)
    print(f"souffle_tvm from {souffle_tvm.__file__}", file=sys.stderr, flush=True)
    with open(args.out, "a") as f:
        for model, small, level in cases(args.quick):
            name = f"{model}/{'small' if small else 'full'}/{level}"
            if args.only and not any(name.startswith(p) for p in args.only):
                continue
            t = time.perf_counter()
            try:
                rec = snapshot(model, small, level)
            except Exception as err:   # recorded, so before/after compare the failure too
                rec = {"case": name, "error": f"{type(err).__name__}: {err}"[:500]}
            f.write(json.dumps(rec, sort_keys=True) + "\n")
            f.flush()
            print(f"{name}: {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
