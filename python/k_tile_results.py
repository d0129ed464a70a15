"""The stitched SIMT GEMMs' K tile chosen by the latency model (16, 32 or 64) against dlight's 16,
side by side in one run at one commit, on the full-size zoo at the default level.

    .venv/bin/python python/k_tile_results.py OUT_DIR [MODEL ...] [--no-nvcc]

Per model two builds, ``before`` (``gemm_k_tile=16``: every SIMT GEMM at dlight's K tile, the
rule's choice before the K tile was chosen) and ``after`` (the default), each saved as
``<build>_<model>.json`` (the CLI's report). ``OUT_DIR/README.md`` gets the table (launches,
analytic bytes, the latency model's estimate under a CUDA graph and its sum of static floors,
SIMT GEMM kernels by K tile with their ptxas figures) and ``k_tile.png`` the plot. Every time
is the model's estimate: no GPU ran these kernels. The last columns re-price the same two
builds with one unpipelined K step costing a load's round trip (``floors.LOAD_LATENCY_CYCLES``)
instead of the fitted ``kstep_cycles`` (at its bound, 2000): how much of the gain rests on that
one constant."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from souffle_tvm.core import latency  # noqa: E402
from souffle_tvm.cost import floors, hardware

# label: (zoo model, its flags)
MODELS = {"efficientnet": ("efficientnet", []), "resnext": ("resnext", []), "mmoe": ("mmoe", []),
          "bert": ("bert", ["--dtype", "float16"]), "bert-fp32": ("bert", []),
          "swin": ("swin", ["--dtype", "float16"]), "lstm": ("lstm", [])}
BUILDS = {"before": ["--gemm-k-tile", "16"], "after": []}
CLI = str(ROOT / ".venv" / "bin" / "souffle-tvm")


def build(out: Path, model: str, name: str, nvcc: bool) -> float:
    path = out / f"{name}_{model}.json"
    zoo, flags = MODELS[model]
    cmd = [CLI, "-q", "compile", zoo, "--target", "cuda", "--fusion", "souffle", *flags,
           *BUILDS[name], "--report", str(path)] + ([] if nvcc else ["--no-nvcc"])
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t


def _k_tile(form: str | None) -> str:
    return form.split("/k")[1].split()[0] if form and "/k" in form else "16"


def summary(path: Path) -> dict:
    r = json.loads(path.read_text())
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


def plot(rows: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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


def main(argv: list[str]) -> int:
    nvcc = "--no-nvcc" not in argv
    args = [a for a in argv if a != "--no-nvcc"]
    out = Path(args[0])
    out.mkdir(parents=True, exist_ok=True)
    models = args[1:] or list(MODELS)
    for model in models:
        for name in BUILDS:
            if not (out / f"{name}_{model}.json").exists():
                print(f"{model} {name}: {build(out, model, name, nvcc):.1f} s", flush=True)
    rows = {m: (summary(out / f"before_{m}.json"), summary(out / f"after_{m}.json")) for m in MODELS
            if (out / f"before_{m}.json").exists() and (out / f"after_{m}.json").exists()}
    (out / "rows.json").write_text(json.dumps(rows, indent=1))
    print(table(rows))
    plot(rows, out / "k_tile.png")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
