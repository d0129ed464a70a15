"""PNG plots of a `make bench` result (souffle_experiments/bench.py's bench.json); matplotlib (bench extra).

    .venv/bin/python -m souffle_experiments bench-plots results/bench-<date>/bench.json   # re-draw

* ``launches.png``: kernel launches per inference, TVM vs Souffle V3, log scale.
* ``roofline.png``: per model, every kernel as a point on the H200 roofline (arithmetic
  intensity vs the attainable FLOP/s the roofline allows it), TVM's and V3's; the area of a
  point is its share of the model's estimated time. Estimates, not measurements.
* ``ablation.png``: launches and estimated latency per ablation level (TVM, V0..V3).
* ``predicted.png``: the latency model's predicted ms per model under CUDA graphs: TVM, V2,
  V3 and the time-driven V3 (estimates, docs/latency-model.md).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")               # files only; no display here or in CI
import matplotlib.pyplot as plt  # noqa: E402

LEVELS = ("tvm", "v0", "v1", "v2", "v3")
COLOURS = {"tvm": "#7f7f7f", "v0": "#c6dbef", "v1": "#6baed6", "v2": "#2171b5", "v3": "#d94801"}


def _gpu(result: dict):
    from souffle_tvm.cost import hardware
    from souffle_tvm.report import roofline

    return hardware.for_arch(result["target"].split("-arch=")[-1]), roofline


def _save(fig, path: Path, dpi: int = 120) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def _ok(rows: list[dict], keys) -> list[dict]:
    """The rows whose configurations all built (a failed build is listed in the tables instead)."""
    return [r for r in rows if all("error" not in r[k] for k in keys)]


def launches(result: dict, out: Path) -> Path:
    rows = _ok(result["compile"], ("tvm", "v3"))
    fig, ax = plt.subplots(figsize=(8, 4))
    x = range(len(rows))
    for i, key in enumerate(("tvm", "v3")):
        vals = [r[key]["launches"] for r in rows]
        bars = ax.bar([j + (i - 0.5) * 0.38 for j in x], vals, 0.38, color=COLOURS[key],
                      label="--fusion tvm" if key == "tvm" else "--fusion souffle (V3)")
        ax.bar_label(bars, fontsize=8)
    ax.set_yscale("log")
    ax.set_xticks(list(x), [f"{r['model']}\n{r['dtype']}" for r in rows])
    ax.set_ylabel("kernel launches per inference (log)")
    ax.set_title(f"Launches per inference, {result['target']} ({result['date']})")
    ax.legend()
    return _save(fig, out / "launches.png")


def roofline_chart(result: dict, out: Path) -> Path:
    gpu, rl = _gpu(result)
    rows = _ok(result["compile"], ("tvm", "v3"))
    cols = 3
    fig, axes = plt.subplots((len(rows) + cols - 1) // cols, cols, figsize=(13, 4 * ((len(rows) + cols - 1) // cols)),
                             squeeze=False)
    for ax, r in zip(axes.flat, rows):
        peak = rl.peak_flops(gpu, r["dtype"])
        ridge = peak / gpu.dram_bandwidth
        xs = [1e-2, ridge, 1e4]
        ax.plot(xs, [min(peak, x * gpu.dram_bandwidth) / 1e12 for x in xs], color="black", lw=1)
        for key in ("tvm", "v3"):
            ks = [(b, f, n) for b, f, n in r[key]["kernels"] if b > 0 and f > 0]
            total = sum(n * max(b / gpu.dram_bandwidth, f / peak) for b, f, n in ks) or 1.0
            ai = [f / b for b, f, _ in ks]
            perf = [min(peak, a * gpu.dram_bandwidth) / 1e12 for a in ai]
            size = [4 + 600 * n * max(b / gpu.dram_bandwidth, f / peak) / total for b, f, n in ks]
            ax.scatter(ai, perf, s=size, alpha=0.55, color=COLOURS[key], edgecolors="none",
                       label=f"{key} ({r[key]['launches']} launches)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"{r['model']} ({r['dtype']})", fontsize=10)
        ax.set_xlabel("flops / global byte")
        ax.set_ylabel("attainable TFLOP/s (estimate)")
        ax.legend(fontsize=8, loc="lower right")
    for ax in list(axes.flat)[len(rows):]:
        ax.axis("off")
    fig.suptitle(f"Kernels on the {gpu.name} roofline: TVM vs Souffle V3 (estimates; point area = share of "
                 "estimated time)", fontsize=11)
    return _save(fig, out / "roofline.png", dpi=110)


def ablation(result: dict, out: Path) -> Path:
    rows = result["compile"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    width = 0.16
    for i, key in enumerate(LEVELS):
        xs = [j + (i - 2) * width for j in range(len(rows))]
        # a level whose build failed is a missing bar (the tables name the error)
        top.bar(xs, [r[key].get("launches", 0) for r in rows], width, color=COLOURS[key], label=key.upper())
        bottom.bar(xs, [r[key].get("roofline_ms_estimate", 0) / r["tvm"]["roofline_ms_estimate"]
                        if "error" not in r["tvm"] else 0 for r in rows], width, color=COLOURS[key])
    top.set_yscale("log")
    top.set_ylabel("launches (log)")
    top.legend(ncol=5, fontsize=8)
    bottom.axhline(1.0, color="black", lw=0.8)
    bottom.set_ylabel("estimated latency / TVM's")
    bottom.set_xticks(range(len(rows)), [r["model"] for r in rows])
    fig.suptitle("Ablation V0-V3 (V4 = V3's kernels + L2 prefetch: same figures): launches and "
                 "roofline-estimated H200 latency")
    return _save(fig, out / "ablation.png")


def predicted(result: dict, out: Path) -> Path:
    keys = ("tvm", "v2", "v3", "v3t")
    rows = [r for r in _ok(result["compile"], keys) if all(r[k].get("predicted_graph_ms") for k in keys)]
    fig, ax = plt.subplots(figsize=(9, 4))
    colours = dict(COLOURS, v3t="#54278f")
    labels = {"tvm": "TVM", "v2": "Souffle V2", "v3": "V3 (budget)", "v3t": "V3 (time-driven)"}
    width = 0.8 / len(keys)
    for i, key in enumerate(keys):
        vals = [r[key]["predicted_graph_ms"] for r in rows]
        ax.bar([j + (i - 1.5) * width for j in range(len(rows))], vals, width, color=colours[key], label=labels[key])
    ax.set_yscale("log")
    ax.set_xticks(list(range(len(rows))), [f"{r['model']}\n{r['dtype']}" for r in rows])
    ax.set_ylabel("predicted ms, under a CUDA graph (log)")
    ax.set_title(f"Latency model ESTIMATES, H200 ({result['date']})")
    ax.legend(fontsize=8)
    return _save(fig, out / "predicted.png")


def plot_all(result: dict, out: Path) -> list[Path]:
    return [launches(result, out), roofline_chart(result, out), ablation(result, out), predicted(result, out)]


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bench_json", help="results/bench-<date>/bench.json; the plots are written beside it")
    p = Path(ap.parse_args(argv).bench_json)
    for f in plot_all(json.loads(p.read_text()), p.parent):
        print(f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
