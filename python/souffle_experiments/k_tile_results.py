"""The stitched SIMT GEMMs' K tile chosen by the latency model (16, 32 or 64) against dlight's 16,
side by side in one run at one commit, on the full-size zoo at the default level.

    .venv/bin/python -m souffle_experiments k-tile-results OUT_DIR [MODEL ...] [--no-nvcc]

A spec of the experiment runner (``runner``). Per model two builds, ``before``
(``gemm_k_tile=16``: every SIMT GEMM at dlight's K tile, the rule's choice before the K tile was
chosen) and ``after`` (the default), each saved as ``<build>_<model>.json`` (the CLI's report;
one already there is not built again). The table printed (for ``OUT_DIR/README.md``: launches,
analytic bytes, the latency model's estimate under a CUDA graph and its sum of static floors,
SIMT GEMM kernels by K tile with their ptxas figures), ``rows.json`` and the plot ``k_tile.png``
cover every model with both reports in OUT_DIR. Every time
is the model's estimate: no GPU ran these kernels. The last columns re-price the same two
builds with one unpipelined K step costing a load's round trip (``floors.LOAD_LATENCY_CYCLES``)
instead of the fitted ``kstep_cycles`` (at its bound, 2000): how much of the gain rests on that
one constant."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from pathlib import Path

from souffle_tvm.cost import floors, hardware, latency

from . import runner
from .paths import ROOT

# label: (zoo model, its flags)
MODELS = {"efficientnet": ("efficientnet", []), "resnext": ("resnext", []), "mmoe": ("mmoe", []),
          "bert": ("bert", ["--dtype", "float16"]), "bert-fp32": ("bert", []),
          "swin": ("swin", ["--dtype", "float16"]), "lstm": ("lstm", [])}
BUILDS = {"before": ["--gemm-k-tile", "16"], "after": []}
CLI = str(ROOT / ".venv" / "bin" / "souffle-tvm")


def build(model: tuple[str, list[str]], options: list[str], cell: runner.Cell, nvcc: bool = True) -> None:
    """One report, written by the CLI at ``cell.path``."""
    zoo, flags = model
    cmd = [CLI, "-q", "compile", zoo, "--target", "cuda", "--fusion", "souffle", *flags,
           *options, "--report", str(cell.path)] + ([] if nvcc else ["--no-nvcc"])
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def _k_tile(form: str | None) -> str:
    return form.split("/k")[1].split()[0] if form and "/k" in form else "16"


def summary(r: dict) -> dict:
    """One report's figures for the table (``r``: the CLI's report)."""
    kernels = latency.kernels_from_rows(r["kernels"])
    gpu = hardware.for_arch(r.get("arch") or "sm_90")
    slow = dataclasses.replace(latency.FITTED, kstep_cycles=float(floors.LOAD_LATENCY_CYCLES))
    at_round_trip = latency.predict(gpu, slow, kernels, graphs=True)
    simt = [k for k in r["kernels"] if k.get("form") and "StitchedMatmul" in k["form"]]
    by_k: dict[str, int] = {}
    for k in simt:
        by_k[_k_tile(k["form"])] = by_k.get(_k_tile(k["form"]), 0) + 1
    regs = [k["registers"] for k in simt if k.get("registers") is not None]
    return {"launches": r["launches"], "mb": r["bytes"] / 1e6, "graph_ms": r["latency"]["graph_ms"],
            "floors_ms": sum(k["launches"] * (k.get("floor_us") or 0) for k in r["kernels"]) / 1e3,
            "graph_ms_round_trip": at_round_trip.seconds * 1e3,
            "simt_by_k_tile": by_k, "simt_max_registers": max(regs) if regs else None,
            "simt_spill_bytes": sum(k.get("spill_bytes") or 0 for k in simt) if regs else None,
            "simt_max_shared": max((k.get("shared_bytes") or 0 for k in simt), default=0),
            "fallback": r.get("fallback")}


def table(rows: dict) -> str:
    lines = ["| model | launches | MB | graph ms before | after | after / before | Σ floors ms before | after | "
             "SIMT GEMM kernels by K tile, after | their max regs, spill B, max smem B | "
             "graph ms at 200 cycles a K step: before | after |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for model, (b, a) in rows.items():
        ks = ", ".join(f"k{k}: {n}" for k, n in sorted(a["simt_by_k_tile"].items(), key=lambda kv: int(kv[0]))) or "-"
        res = (f"{a['simt_max_registers']}, {a['simt_spill_bytes']}, {a['simt_max_shared']}"
               if a["simt_max_registers"] is not None else f"no ptxas, -, {a['simt_max_shared']}")
        launches = f"{b['launches']}" if b["launches"] == a["launches"] else f"{b['launches']} -> {a['launches']}"
        mb = f"{b['mb']:.2f}" if abs(b["mb"] - a["mb"]) < 0.005 else f"{b['mb']:.2f} -> {a['mb']:.2f}"
        lines.append(f"| {model} | {launches} | {mb} | {b['graph_ms']:.3f} | {a['graph_ms']:.3f} | "
                     f"{a['graph_ms'] / b['graph_ms']:.2f} | {b['floors_ms']:.3f} | {a['floors_ms']:.3f} | {ks} | {res} | "
                     f"{b['graph_ms_round_trip']:.3f} | {a['graph_ms_round_trip']:.3f} |")
    return "\n".join(lines)


def rows(cells: runner.Cells) -> dict:
    """{model: (before, after)} for every model with both reports, in MODELS' order."""
    return {m: (summary(cells[m]["before"]), summary(cells[m]["after"])) for m in MODELS
            if set(BUILDS) <= set(cells.get(m, {}))}


def plot(rows: dict, path: Path) -> None:
    plt = runner.pyplot()
    models = list(rows)
    fig, ax = plt.subplots(figsize=(8, 4.4))
    width = 0.2
    series = [("before, fitted K step", lambda b, a: b["graph_ms"], "#bbbbbb"),
              ("after, fitted K step", lambda b, a: a["graph_ms"], "#3b75af"),
              ("before, 200-cycle K step", lambda b, a: b["graph_ms_round_trip"], "#e4c9a0"),
              ("after, 200-cycle K step", lambda b, a: a["graph_ms_round_trip"], "#c2712f")]
    for i, (label, fn, colour) in enumerate(series):
        ax.bar([x + (i - 1.5) * width for x in range(len(models))],
               [fn(*rows[m]) / rows[m][0]["graph_ms"] for m in models], width, label=label, color=colour)
    ax.set_xticks(range(len(models)), models)
    ax.set_ylabel("predicted graph time / before (fitted)")
    ax.set_title("SIMT GEMM K tile chosen vs dlight's 16 (latency-model estimates, no GPU)")
    ax.axhline(1.0, color="black", linewidth=0.6)
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.08), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def spec(nvcc: bool = True) -> runner.Spec:
    return runner.Spec("k-tile-results", BUILDS, rows, build=lambda m, o, c: build(m, o, c, nvcc), table=table,
                       plot=plot, plot_file="k_tile.png", rows_file="rows.json")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="the results folder (its reports are kept; the missing ones built)")
    ap.add_argument("models", nargs="*", help=f"models to build (default all: {' '.join(MODELS)})")
    ap.add_argument("--no-nvcc", action="store_true", help="skip ptxas (no register figures)")
    args = ap.parse_args(argv)
    unknown = set(args.models) - set(MODELS)
    if unknown:
        ap.error(f"unknown models {sorted(unknown)}; choose from {list(MODELS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runner.run(spec(not args.no_nvcc), out, MODELS, runner.ReportFiles(out), build_only=args.models or list(MODELS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
