"""Counted traffic (the GPU emulator, ``runtime.traffic``) before and after the K tile choice.

    .venv/bin/python python/k_tile_counted.py OUT_DIR [--full efficientnet]

Builds each small zoo model at the default level twice, ``gemm_k_tile=16`` (before) and the
default (after), and the full-size GEMMs whose K tile the choice changes most (EfficientNet-B0's
7 x 7 1x1 convolution, 49 x 1152 x 192, and ResNeXt's 14 x 14 one, 196 x 1024 x 512, as single
MatMuls), runs their kernels in the emulator and writes ``OUT_DIR/counted.json`` and
``counted.md``: launches, the report's analytic bytes, the counted distinct bytes that cross the
chip boundary, the bytes of the 32-byte sectors the warps' requests touch (what L1/L2 serve),
and whether every kernel's analytic bytes equal its counted ones. ``--full NAME``: a full-size
zoo model too (slow: the emulator runs every thread of every kernel on the CPU)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "python"))

import microbench  # noqa: E402 - the single-operator builders
from souffle_tvm.pipeline.driver import compile as compile_model  # noqa: E402

SMALL = ("efficientnet", "resnext", "mmoe", "bert", "swin", "lstm")
GEMMS = {"gemm 49x1152x192 (EfficientNet 7x7 1x1 conv)": (49, 1152, 192),
         "gemm 196x1024x512 (ResNeXt 14x14 1x1 conv)": (196, 1024, 512)}
BUILDS = {"before": {"gemm_k_tile": 16}, "after": {}}


def count(model, small: bool, **options) -> dict:
    t = time.perf_counter()
    r = compile_model(model, "cuda", "souffle", small=small, nvcc=False, count_traffic=True, **options).report
    c = r.counted or {}
    forms = sorted({k.form for k in r.kernels if k.form and "StitchedMatmul" in k.form})
    return {"launches": r.launches, "analytic_bytes": r.bytes, "counted_bytes": c.get("bytes"),
            "sector_bytes": c.get("sector_bytes"), "held": c.get("analytic_held"),
            "differences": c.get("differences"), "simt_forms": forms,
            "graph_ms": r.latency["graph_ms"] if r.latency else None, "seconds": round(time.perf_counter() - t, 1)}


def table(rows: dict) -> str:
    lines = ["| model | launches | analytic KB before / after | counted KB before / after | sector KB before / "
             "after | analytic = counted, after | SIMT GEMM forms after |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in rows.items():
        b, a = r["before"], r["after"]
        kb = lambda x: f"{x / 1e3:.1f}" if x is not None else "-"  # noqa: E731
        launches = f"{b['launches']}" if b["launches"] == a["launches"] else f"{b['launches']} / {a['launches']}"
        lines.append(f"| {name} | {launches} | {kb(b['analytic_bytes'])} / {kb(a['analytic_bytes'])} | "
                     f"{kb(b['counted_bytes'])} / {kb(a['counted_bytes'])} | {kb(b['sector_bytes'])} / "
                     f"{kb(a['sector_bytes'])} | {a['held']} | {', '.join(a['simt_forms']) or '-'} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    full = argv[argv.index("--full") + 1:] if "--full" in argv else []
    out.mkdir(parents=True, exist_ok=True)
    path = out / "counted.json"
    rows = json.loads(path.read_text()) if path.exists() else {}
    todo = [(f"{m} (small)", m, True) for m in SMALL] + \
           [(name, microbench.matmul(*shape), False) for name, shape in GEMMS.items()] + \
           [(f"{m} (full)", m, False) for m in full]
    for name, model, small in todo:
        if name in rows:
            continue
        rows[name] = {b: count(model, small, **opts) for b, opts in BUILDS.items()}
        print(name, {b: (r["counted_bytes"], r["sector_bytes"], r["seconds"]) for b, r in rows[name].items()},
              flush=True)
        path.write_text(json.dumps(rows, indent=1))
    (out / "counted.md").write_text(table(rows) + "\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
