"""Tabulate and plot the resident-weight results: JSON reports of `souffle-tvm compile --report`
in one directory, named ``<build>_<model>.json``, where ``build`` is one of BUILDS.

    python python/resident_results.py results/resident-weights-2026-12-03

Prints a markdown table (launches, analytic bytes, counted bytes where the emulator ran: summed
over a stitched kernel's stages, and distinct over the call, the
latency model's estimate under a CUDA graph, and per stitched kernel its ptxas figures and the
shared memory its weight copies take) and writes ``resident.png`` beside the reports."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BUILDS = (("tvm", "TVM's kernels (--fusion tvm)"),
          ("offchip", "souffle v3, --off-chip (no channels, chains or copies)"),
          ("before", "souffle v3 before resident weights (b986d90)"),
          ("v3", "souffle v3 with resident weights"),
          ("auto", "souffle default level with resident weights"))


def rows(folder: Path) -> list[dict]:
    out = []
    for path in sorted(folder.glob("*.json")):
        build, _, model = path.stem.partition("_")
        label = dict(BUILDS).get(build)
        if label is None:
            continue
        r = json.loads(path.read_text())
        counted = (r.get("counted") or {}).get("bytes")
        # a stitched kernel's distinct bytes count a weight re-read at every step once; summed
        # over its stages (each counted as if alone) they count every re-read, as separate kernels do
        staged = sum(k["launches"] * (sum(st["distinct_bytes"] for st in k["counted"]["stages"])
                                      if k["counted"].get("stages") else k["counted"]["distinct_bytes"])
                     for k in r["kernels"] if k.get("counted")) if counted else None
        stitched = [k for k in r["kernels"] if k.get("stages")]
        out.append({"model": model, "build": build, "label": label, "launches": r["launches"],
                    "mb": r["bytes"] / 1e6, "counted_mb": counted / 1e6 if counted else None,
                    "staged_mb": staged / 1e6 if staged else None,
                    "graph_ms": r["latency"]["graph_ms"] if r.get("latency") else None,
                    "kernels": [(k["registers"], k["shared_bytes"], k["spill_bytes"], k["grid"][0], k["block"][0])
                                for k in stitched]})
    order = [b for b, _ in BUILDS]
    return sorted(out, key=lambda d: (d["model"], order.index(d["build"])))


def table(data: list[dict]) -> str:
    lines = ["| model | build | launches | MB (analytic) | MB counted, per stage | MB counted, per call | "
             "graph ms (estimate) | stitched kernels: regs, smem B, spill B; blocks x threads |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for d in data:
        figures = "; ".join(f"{r}, {s}, {sp}, {g} x {b}" for r, s, sp, g, b in d["kernels"]) or "-"
        counted = f"{d['counted_mb']:.3f}" if d["counted_mb"] is not None else "-"
        staged = f"{d['staged_mb']:.3f}" if d["staged_mb"] is not None else "-"
        ms = f"{d['graph_ms']:.3f}" if d["graph_ms"] is not None else "-"
        lines.append(f"| {d['model']} | {d['label']} | {d['launches']} | {d['mb']:.2f} | {staged} | {counted} | {ms} | {figures} |")
    return "\n".join(lines)


def plot(data: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({d["model"] for d in data})
    fig, axes = plt.subplots(len(models), 2, figsize=(11, 2.6 * len(models)), squeeze=False)
    for row, model in zip(axes, models):
        mine = [d for d in data if d["model"] == model]
        names = [d["build"] for d in mine]
        row[0].barh(names, [d["mb"] for d in mine], color="tab:blue")
        row[0].set_xscale("log")
        row[0].set_xlabel("MB moved per inference (analytic; log scale)")
        row[0].set_title(model)
        timed = [d for d in mine if d["graph_ms"] is not None]
        row[1].barh([d["build"] for d in timed], [d["graph_ms"] for d in timed], color="tab:orange")
        row[1].set_xlabel("ms under a CUDA graph (latency-model ESTIMATE, no GPU)")
        for ax in row:
            ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str]) -> int:
    folder = Path(argv[0] if argv else ".")
    data = rows(folder)
    print(table(data))
    plot(data, folder / "resident.png")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
