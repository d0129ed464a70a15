"""Kernel launches per inference: `--fusion tvm` vs `--fusion souffle` (V2 and V3), six models, one run.

Compiles each model with TVM's fusion and with Souffle at level v2 (one kernel per anchor
group) and v3 (subprograms stitched into cooperative kernels) for CUDA (sm_90 by default;
no GPU needed) and writes
``results/launches-<date>.json`` and a Markdown table beside it. Compile times include ptxas
unless ``--no-nvcc``. Absolute run times need a GPU; this script claims none.

    .venv/bin/python python/bench_launches.py [--models bert lstm] [--arch sm_90] [--small] [--no-nvcc]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import tvm

from souffle_tvm import hardware, roofline, zoo
from souffle_tvm.api import compile as compile_model
from souffle_tvm.frontend import import_onnx

CONFIGS = (("tvm", "tvm", None), ("souffle_v2", "souffle", "v2"), ("souffle_v3", "souffle", "v3"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="*", default=zoo.names())
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--small", action="store_true", help="small variants (a quick smoke run)")
    ap.add_argument("--no-nvcc", action="store_true", help="skip ptxas (faster; no register figures)")
    ap.add_argument("--out", default="results")
    args = ap.parse_args()

    rows = []
    gpu = hardware.for_arch(args.arch)
    total = len(args.models) * len(CONFIGS)
    step = 0
    for name in args.models:
        dtype = zoo.MODELS[name].paper_dtype
        compulsory = roofline.compulsory_bytes(import_onnx(name, small=args.small, dtype=dtype))
        row = {"model": name, "dtype": dtype, "compulsory_bytes": compulsory}
        for key, fusion, level in CONFIGS:
            step += 1
            print(f"[{step}/{total}] {name} ({dtype}) --fusion {fusion} {level or ''} ...", flush=True)
            t = time.perf_counter()
            c = compile_model(name, "cuda", fusion, arch=args.arch, small=args.small, dtype=dtype,
                              nvcc=not args.no_nvcc, level=level or "v2")
            r = c.report
            est = roofline.estimate(r, gpu, dtype, compulsory)
            row["roofline_floor_ms_estimate"] = round(est.floor * 1e3, 4)
            row[key] = {"roofline_ms_estimate": round(est.seconds * 1e3, 4),"launches": r.launches, "distinct_kernels": r.distinct_kernels,
                        "compile_seconds": r.compile_seconds, "total_seconds": round(time.perf_counter() - t, 2),
                        "nvcc_seconds": r.nvcc.get("seconds"), "bytes": r.bytes, "flops": r.flops,
                        "grid_syncs": sum((k.grid_syncs or 0) * k.launches for k in r.kernels)}
            print(f"    launches {r.launches}, distinct kernels {r.distinct_kernels}, build {r.compile_seconds:.1f} s",
                  flush=True)
        rows.append(row)

    os.makedirs(args.out, exist_ok=True)
    stamp = datetime.date.today().isoformat()
    meta = {"date": stamp, "tvm": tvm.__version__, "target": f"cuda -arch={args.arch}", "small": args.small,
            "machine": f"{os.cpu_count()} CPU cores, no GPU (compile only)"}
    path = os.path.join(args.out, f"launches-{stamp}{'-small' if args.small else ''}.json")
    with open(path, "w") as f:
        json.dump({**meta, "models": rows}, f, indent=2)
    lines = ["| model | dtype | launches tvm | souffle v2 | souffle v3 | v3 grid syncs | tvm / v3 "
             "| build s tvm | v2 | v3 | est. ms tvm | est. ms v3 | est. floor ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t, v2, v3 = r["tvm"], r["souffle_v2"], r["souffle_v3"]
        lines.append(f"| {r['model']} | {r['dtype']} | {t['launches']} | {v2['launches']} | {v3['launches']} | "
                     f"{v3['grid_syncs']} | {t['launches'] / max(v3['launches'], 1):.1f}x | "
                     f"{t['compile_seconds']:.1f} | {v2['compile_seconds']:.1f} | {v3['compile_seconds']:.1f} | "
                     f"{t['roofline_ms_estimate']:.3f} | {v3['roofline_ms_estimate']:.3f} | "
                     f"{r['roofline_floor_ms_estimate']:.3f} |")
    table = "\n".join(lines)
    with open(path.replace(".json", ".md"), "w") as f:
        f.write(f"Kernel launches per inference, {meta['target']}, {stamp}, TVM {meta['tvm']}; souffle v2 = "
                f"transforms + one kernel per anchor group; v3 = + subprograms stitched with grid syncs. "
                f"est. ms: roofline ESTIMATES for {gpu.name} (souffle_tvm/roofline.py), not measurements\n\n{table}\n")
    print(table)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
