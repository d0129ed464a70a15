"""Counted traffic (the GPU emulator, ``runtime.traffic``) before and after the K tile choice.

    .venv/bin/python -m souffle_experiments k-tile-counted OUT_DIR [--full efficientnet]

Builds each small zoo model at the default level twice, ``gemm_k_tile=16`` (before) and the
default (after), and the full-size GEMMs whose K tile the choice changes most (EfficientNet-B0's
7 x 7 1x1 convolution, 49 x 1152 x 192, and ResNeXt's 14 x 14 one, 196 x 1024 x 512, as single
MatMuls), runs their kernels in the emulator and writes ``OUT_DIR/counted.json`` and
``counted.md``: launches, the report's analytic bytes, the counted distinct bytes that cross the
chip boundary, the bytes of the 32-byte sectors the warps' requests touch (what L1/L2 serve),
and whether every kernel's analytic bytes equal its counted ones. ``--full NAME``: a full-size
zoo model too (slow: the emulator runs every thread of every kernel on the CPU). A spec of the
experiment runner (``runner``): the cells already in ``counted.json`` are kept, not counted again."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from souffle_tvm.pipeline.driver import compile as compile_model

from . import microbench  # the single-operator builders
from . import runner

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


def models(full: list[str]) -> dict[str, tuple]:
    """{label: (zoo name or GEMM shape, small)}: the small zoo, the two GEMMs, ``full`` at full size."""
    return {**{f"{m} (small)": (m, True) for m in SMALL}, **{name: (shape, False) for name, shape in GEMMS.items()},
            **{f"{m} (full)": (m, False) for m in full}}


def model_of(ref) -> object:
    """A zoo name as it is; a GEMM's shape as its single-MatMul ONNX model."""
    return microbench.matmul(*ref) if isinstance(ref, tuple) else ref


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


SPEC = runner.Spec("k-tile-counted", BUILDS, rows=lambda cells: {m: c for m, c in cells.items() if set(BUILDS) <= set(c)},
                   build=lambda model, opts, _: count(model_of(model[0]), model[1], **opts),
                   table=table, table_file="counted.md",
                   progress=lambda m, b, r, _: f"{m} {b}: {(r['counted_bytes'], r['sector_bytes'], r['seconds'])}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="folder of counted.json (kept and extended) and counted.md")
    ap.add_argument("--full", nargs="*", default=[], help="full-size zoo models too (slow)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    store = runner.JsonCells(out / "counted.json")
    todo = models(args.full)
    # the table keeps every model counted.json holds, in its order, then this run's new ones
    labels = store.models() + [m for m in todo if m not in store.models()]
    runner.run(SPEC, out, {m: todo.get(m) for m in labels}, store, build_only=list(todo))
    return 0


if __name__ == "__main__":
    sys.exit(main())
