"""The TVM-fusion baseline for the six zoo models at full size: launches, kernels, compile times.

Writes ``results/baseline-<date>.json`` and a Markdown table. This is the ``tvm`` column of the
paper's comparison; the ``souffle`` column joins it when the Souffle pipeline lands.

    .venv/bin/python python/bench_tvm_baseline.py [--models bert lstm] [--arch sm_90] [--small]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import tvm

from souffle_tvm import zoo
from souffle_tvm.api import compile as compile_model


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="*", default=zoo.names())
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--small", action="store_true", help="small variants (a quick smoke run)")
    ap.add_argument("--out", default="results")
    args = ap.parse_args()

    rows = []
    for i, name in enumerate(args.models, 1):
        dtype = zoo.MODELS[name].paper_dtype
        print(f"[{i}/{len(args.models)}] {name} ({dtype}) ...", flush=True)
        t = time.perf_counter()
        c = compile_model(name, "cuda", "tvm", arch=args.arch, small=args.small, dtype=dtype)
        total = time.perf_counter() - t
        r = c.report
        rows.append({"model": name, "dtype": dtype, "launches": r.launches, "distinct_kernels": r.distinct_kernels,
                     "compile_seconds": r.compile_seconds, "total_seconds": round(total, 2),
                     "nvcc_seconds": r.nvcc.get("seconds"), "bytes": r.bytes, "flops": r.flops})
        print(f"    launches {r.launches}, distinct kernels {r.distinct_kernels}, build {r.compile_seconds:.1f} s, "
              f"total {total:.1f} s", flush=True)

    os.makedirs(args.out, exist_ok=True)
    stamp = datetime.date.today().isoformat()
    meta = {"date": stamp, "tvm": tvm.__version__, "target": f"cuda -arch={args.arch}", "fusion": "tvm",
            "small": args.small, "machine": f"{os.cpu_count()} CPU cores, no GPU (compile only)"}
    path = os.path.join(args.out, f"baseline-{stamp}{'-small' if args.small else ''}.json")
    with open(path, "w") as f:
        json.dump({**meta, "models": rows}, f, indent=2)
    lines = ["| model | dtype | launches | distinct kernels | build s | total s (import+build+nvcc) | GB moved | GFLOP |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['dtype']} | {r['launches']} | {r['distinct_kernels']} | "
                     f"{r['compile_seconds']:.1f} | {r['total_seconds']:.1f} | {r['bytes'] / 1e9:.3f} | {r['flops'] / 1e9:.2f} |")
    table = "\n".join(lines)
    with open(path.replace(".json", ".md"), "w") as f:
        f.write(f"TVM default fusion, {meta['target']}, {stamp}, TVM {meta['tvm']}\n\n{table}\n")
    print(table)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
