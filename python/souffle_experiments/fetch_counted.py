"""Counted traffic (the GPU emulator) of the default build at this checkout, for comparing two
checkouts' schedules under one counter.

    .venv/bin/python -m souffle_experiments fetch-counted count OUT.json [--full efficientnet ...]
    .venv/bin/python -m souffle_experiments fetch-counted table BEFORE.json AFTER.json OUT.md

``count`` builds each small zoo model and the two full-size GEMMs of ``k_tile_counted`` at the
default level (``--fusion souffle``) and with TVM's own kernels (``--fusion tvm``), runs their
kernels in the emulator and writes launches, analytic bytes, counted distinct bytes, sector
bytes and requests per build. Run it from two checkouts with the same ``runtime/`` (the
counter) to see what a schedule change alone does; ``table`` puts the two side by side.
``count`` is a spec of the experiment runner (``runner``): the builds already in OUT.json are kept;
``table`` compares two runs, made at two checkouts, so it stays a function of its own."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from souffle_tvm.pipeline.driver import compile as compile_model

from . import runner
from .k_tile_counted import model_of, models


def count(model, small: bool, fusion: str) -> dict:
    t = time.perf_counter()
    r = compile_model(model, "cuda", fusion, small=small, nvcc=False, count_traffic=True).report
    c = r.counted or {}
    requests = sum(k.launches * k.counted["requests"] for k in r.kernels if k.counted)
    return {"launches": r.launches, "analytic_bytes": r.bytes, "counted_bytes": c.get("bytes"),
            "sector_bytes": c.get("sector_bytes"), "requests": requests, "held": c.get("analytic_held"),
            "seconds": round(time.perf_counter() - t, 1)}


# the runner's builds: one per fusion; cells under "<model> | <fusion>" in OUT.json
SPEC = runner.Spec("fetch-counted count", {"souffle": "souffle", "tvm": "tvm"}, rows=lambda cells: cells,
                   build=lambda model, fusion, _: count(model_of(model[0]), model[1], fusion),
                   progress=lambda m, b, r, _: f"{m} | {b} {r}")


def run(out: Path, full: list[str]) -> None:
    runner.run(SPEC, out.parent, models(full), runner.JsonCells(out, "flat"))


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("count", help="count this checkout's builds into OUT.json (kept and extended)")
    c.add_argument("out")
    c.add_argument("--full", nargs="*", default=[], help="full-size zoo models too (slow)")
    t = sub.add_parser("table", help="two counts side by side, written to OUT.md")
    t.add_argument("before")
    t.add_argument("after")
    t.add_argument("out")
    args = ap.parse_args(argv)
    if args.cmd == "count":
        run(Path(args.out), args.full)
    else:
        text = table(json.loads(Path(args.before).read_text()), json.loads(Path(args.after).read_text()))
        Path(args.out).write_text(text + "\n")
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
