"""Tabulate and plot the row-chain results: JSON reports of `souffle-tvm compile --report`,
named ``{tvm,base,head}_{model}_{auto,small_v3,small}.json`` in one directory (``base``: the
commit before row chains; ``head``: with them; ``tvm``: TVM's own kernels).

    python -m souffle_experiments row-chain-results results/row-chains-2026-12-03

A spec of the experiment runner (``runner``) with no builds: the reports were made elsewhere
(``base`` at its own commit). Prints a markdown table (launches, analytic bytes, counted bytes where the emulator ran, the
latency model's estimate under a CUDA graph, the row-chain kernels' ptxas figures) and writes
``row_chains.png`` beside the reports."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import runner

BUILDS = (("tvm", "TVM's kernels"), ("base", "souffle before"), ("head", "souffle with row chains"))
# the runner's models: "<model>/<size>", in the table's order
CASES = [f"{model}/{size}" for model in ("bert", "swin") for size in ("auto", "small_v3")]


def report_name(case: str, build: str) -> str:
    """The report file of one case and build (``tvm``: TVM's own build at each size)."""
    model, size = case.split("/")
    return f"{build}_{model}_small.json" if build == "tvm" and size == "small_v3" else \
        f"{build}_{model}.json" if build == "tvm" else f"{build}_{model}_{size}.json"


def _chain_kernels(report: dict) -> list[dict]:
    return [k for k in report["kernels"] if "RowChain" in (k.get("form") or "")]


def rows(cells: runner.Cells) -> list[dict]:
    out = []
    for case, by_build in cells.items():
        model, size = case.split("/")
        for build, label in BUILDS:
            r = by_build.get(build)
            if r is None:
                continue
            counted = (r.get("counted") or {}).get("bytes")
            chains = _chain_kernels(r)
            out.append({"model": model, "size": "full, default level" if size == "auto" else "small, v3 (tvm: its own)",
                        "build": label, "launches": r["launches"], "mb": r["bytes"] / 1e6,
                        "counted_mb": counted / 1e6 if counted else None,
                        "graph_ms": r["latency"]["graph_ms"],
                        "chains": sum(k["launches"] for k in chains),
                        "chain_figures": sorted({(k["registers"], k["shared_bytes"], k["spill_bytes"],
                                                  k["grid"][0], k["block"][0]) for k in chains})})
    return out


def table(data: list[dict]) -> str:
    lines = ["| model | size | build | launches | MB (analytic) | MB (counted) | graph ms (estimate) | "
             "launches of kernels with a row chain | their ptxas: regs, smem B, spill B; blocks x threads |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for d in data:
        figures = "; ".join(f"{r}, {s}, {sp}, {g} x {b}" for r, s, sp, g, b in d["chain_figures"]) or "-"
        counted = f"{d['counted_mb']:.3f}" if d["counted_mb"] is not None else "-"
        lines.append(f"| {d['model']} | {d['size']} | {d['build']} | {d['launches']} | {d['mb']:.3f} | {counted} | "
                     f"{d['graph_ms']:.3f} | {d['chains']} | {figures} |")
    return "\n".join(lines)


def plot(data: list[dict], path: Path) -> None:
    plt = runner.pyplot()
    full = [d for d in data if d["size"].startswith("full")]
    models = sorted({d["model"] for d in full})
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in ((axes[0], "mb", "global traffic per inference (MB, analytic)"),
                           (axes[1], "graph_ms", "latency-model estimate under a CUDA graph (ms)")):
        for i, (_, label) in enumerate(BUILDS):
            vals = [next((d[key] for d in full if d["model"] == m and d["build"] == label), 0) for m in models]
            ax.bar([x + 0.27 * i for x in range(len(models))], vals, width=0.27, label=label)
        ax.set_xticks([x + 0.27 for x in range(len(models))], [f"{m} fp16 (full)" for m in models])
        ax.set_title(title, fontsize=9)
    axes[0].legend(fontsize=8)
    fig.suptitle("Row chains (attention on chip): no GPU timed these; the times are estimates", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


SPEC = runner.Spec("row-chain-results", dict(BUILDS), rows, table=table, plot=plot, plot_file="row_chains.png")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", nargs="?", default="results/row-chains-2026-12-03",
                    help="the reports' folder; the plot is written there")
    folder = Path(ap.parse_args(argv).folder)
    runner.run(SPEC, folder, dict.fromkeys(CASES), runner.ReportFiles(folder, report_name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
