"""Tabulate and plot the resident-weight results: JSON reports of `souffle-tvm compile --report`
in one directory, named ``<build>_<model>.json``, where ``build`` is one of BUILDS.

    python -m souffle_experiments resident-results results/resident-weights-2026-12-03
    python -m souffle_experiments resident-results results/joint-tiles-2026-12-05 --preset joint-tiles
    python -m souffle_experiments resident-results results/mbconv-chains-2026-12-05 --preset mbconv-chains

A spec of the experiment runner (``runner``) with no builds: the reports were made elsewhere
(each build at its own commit). Prints a markdown table (launches, analytic bytes, counted bytes where the emulator ran: summed
over a stitched kernel's stages, and distinct over the call, the L1 sectors its warps touched, the
latency model's estimate under a CUDA graph, and per stitched kernel its ptxas figures and the
shared memory its weight copies take) and writes the preset's plot beside the reports."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import runner

BUILDS = (("tvm", "TVM's kernels (--fusion tvm)"),
          ("offchip", "souffle v3, --off-chip (no channels, chains or copies)"),
          ("before", "souffle v3 before resident weights (b986d90)"),
          ("v3", "souffle v3 with resident weights"),
          ("auto", "souffle default level with resident weights"))
# the joint-tiling results: the default level before it (3fd6f02) and after
JOINT_BUILDS = (("tvm", "TVM's kernels (--fusion tvm)"),
                ("before", "souffle default level before joint tiling (3fd6f02)"),
                ("auto", "souffle default level with joint tiling"))
# the MBConv chains: session start (48980e3), with the prologues (f72c88d), with the window chains
MBCONV_BUILDS = (("tvm", "TVM's kernels (--fusion tvm)"),
                 ("offchip", "souffle default level, --off-chip (no chains, channels or copies)"),
                 ("before", "souffle default level before (48980e3)"),
                 ("prologue", "souffle default level with prologues (f72c88d)"),
                 ("auto", "souffle default level with prologues and window chains"))
PRESETS = {"resident": (BUILDS, "resident.png"), "joint-tiles": (JOINT_BUILDS, "joint-tiles.png"),
           "mbconv-chains": (MBCONV_BUILDS, "mbconv-chains.png")}


def rows(cells: runner.Cells, builds=BUILDS) -> list[dict]:
    out = []
    for model, by_build in cells.items():
        for build, r in by_build.items():
            label = dict(builds)[build]
            counted = (r.get("counted") or {}).get("bytes")
            sectors = (r.get("counted") or {}).get("sector_bytes")
            # a stitched kernel's distinct bytes count a weight re-read at every step once; summed
            # over its stages (each counted as if alone) they count every re-read, as separate kernels do
            staged = sum(k["launches"] * (sum(st["distinct_bytes"] for st in k["counted"]["stages"])
                                          if k["counted"].get("stages") else k["counted"]["distinct_bytes"])
                         for k in r["kernels"] if k.get("counted")) if counted else None
            stitched = [k for k in r["kernels"] if k.get("stages")]
            out.append({"model": model, "build": build, "label": label, "launches": r["launches"],
                        "mb": r["bytes"] / 1e6, "counted_mb": counted / 1e6 if counted else None,
                        "staged_mb": staged / 1e6 if staged else None,
                        "sector_mb": sectors / 1e6 if sectors else None,
                        "graph_ms": r["latency"]["graph_ms"] if r.get("latency") else None,
                        "kernels": [(k["registers"], k["shared_bytes"], k["spill_bytes"], k["grid"][0], k["block"][0])
                                    for k in stitched]})
    order = [b for b, _ in builds]
    return sorted(out, key=lambda d: (d["model"], order.index(d["build"])))


def table(data: list[dict]) -> str:
    lines = ["| model | build | launches | MB (analytic) | MB counted, per stage | MB counted, per call | "
             "L1 sector MB counted | graph ms (estimate) | stitched kernels: regs, smem B, spill B; blocks x threads |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for d in data:
        figures = "; ".join(f"{n} x ({_figures(k)})" if n > 1 else _figures(k) for k, n in _runs(d["kernels"])) or "-"
        counted = f"{d['counted_mb']:.3f}" if d["counted_mb"] is not None else "-"
        staged = f"{d['staged_mb']:.3f}" if d["staged_mb"] is not None else "-"
        sectors = f"{d['sector_mb']:.1f}" if d["sector_mb"] is not None else "-"
        ms = f"{d['graph_ms']:.3f}" if d["graph_ms"] is not None else "-"
        lines.append(f"| {d['model']} | {d['label']} | {d['launches']} | {d['mb']:.2f} | {staged} | {counted} | "
                     f"{sectors} | {ms} | {figures} |")
    return "\n".join(lines)


def _figures(kernel: tuple) -> str:
    regs, smem, spill, grid, block = kernel
    return (f"{regs}, {smem}, {spill}" if regs is not None else "no ptxas") + f"; {grid} x {block}"


def _runs(kernels: list) -> list[tuple]:
    """Consecutive equal kernels' figures once, with their count."""
    out: list = []
    for k in kernels:
        if out and out[-1][0] == k:
            out[-1] = (k, out[-1][1] + 1)
        else:
            out.append((k, 1))
    return out


def plot(data: list[dict], path: Path) -> None:
    plt = runner.pyplot()
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


def spec(preset: str = "resident") -> runner.Spec:
    builds, picture = PRESETS[preset]
    return runner.Spec(f"resident-results --preset {preset}", dict(builds), lambda cells: rows(cells, builds),
                       table=table, plot=plot, plot_file=picture)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", nargs="?", default=".", help="the reports' folder; the plot is written there")
    ap.add_argument("--preset", default="resident", choices=list(PRESETS))
    args = ap.parse_args(argv)
    folder = Path(args.folder)
    runner.run(spec(args.preset), folder, store=runner.ReportFiles(folder))
    return 0


if __name__ == "__main__":
    sys.exit(main())
