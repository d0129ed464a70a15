"""Counted traffic (the GPU emulator) of the default build at this checkout, for comparing two
checkouts' schedules under one counter.

    .venv/bin/python python/fetch_counted.py count OUT.json [--full efficientnet ...]
    .venv/bin/python python/fetch_counted.py table BEFORE.json AFTER.json OUT.md

``count`` builds each small zoo model and the two full-size GEMMs of ``k_tile_counted`` at the
default level (``--fusion souffle``) and with TVM's own kernels (``--fusion tvm``), runs their
kernels in the emulator and writes launches, analytic bytes, counted distinct bytes, sector
bytes and requests per build. Run it from two checkouts with the same ``runtime/`` (the
counter) to see what a schedule change alone does; ``table`` puts the two side by side."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "python"))

import microbench  # noqa: E402 - the single-operator builders
from k_tile_counted import GEMMS, SMALL  # noqa: E402
from souffle_tvm.pipeline.driver import compile as compile_model  # noqa: E402


def count(model, small: bool, fusion: str) -> dict:
    t = time.perf_counter()
    r = compile_model(model, "cuda", fusion, small=small, nvcc=False, count_traffic=True).report
    c = r.counted or {}
    requests = sum(k.launches * k.counted["requests"] for k in r.kernels if k.counted)
    return {"launches": r.launches, "analytic_bytes": r.bytes, "counted_bytes": c.get("bytes"),
            "sector_bytes": c.get("sector_bytes"), "requests": requests, "held": c.get("analytic_held"),
            "seconds": round(time.perf_counter() - t, 1)}


def run(out: Path, full: list[str]) -> None:
    rows = json.loads(out.read_text()) if out.exists() else {}
    todo = [(f"{m} (small)", m, True) for m in SMALL] + \
           [(name, microbench.matmul(*shape), False) for name, shape in GEMMS.items()] + \
           [(f"{m} (full)", m, False) for m in full]
    for name, model, small in todo:
        for fusion in ("souffle", "tvm"):
            key = f"{name} | {fusion}"
            if key in rows:
                continue
            rows[key] = count(model, small, fusion)
            print(key, rows[key], flush=True)
            out.write_text(json.dumps(rows, indent=1))


def table(before: dict, after: dict) -> str:
    lines = ["| model | fusion | launches | counted MB | sector MB before | after | after / before | "
             "sectors a request before | after |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for key, a in after.items():
        b = before.get(key)
        if b is None:
            continue
        name, fusion = key.split(" | ")
        spr = lambda r: r["sector_bytes"] / 32 / r["requests"] if r["requests"] else float("nan")  # noqa: E731
        same = b["counted_bytes"] == a["counted_bytes"]
        lines.append(f"| {name} | {fusion} | {a['launches']} | {a['counted_bytes'] / 1e6:.3f}"
                     f"{'' if same else ' (before ' + format(b['counted_bytes'] / 1e6, '.3f') + ')'} | "
                     f"{b['sector_bytes'] / 1e6:.2f} | {a['sector_bytes'] / 1e6:.2f} | "
                     f"{a['sector_bytes'] / b['sector_bytes']:.2f} | {spr(b):.2f} | {spr(a):.2f} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if argv[0] == "count":
        run(Path(argv[1]), argv[argv.index("--full") + 1:] if "--full" in argv else [])
    elif argv[0] == "table":
        text = table(json.loads(Path(argv[1]).read_text()), json.loads(Path(argv[2]).read_text()))
        Path(argv[3]).write_text(text + "\n")
        print(text)
    else:
        raise SystemExit(__doc__)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
