"""How much L2 residency between kernels could change the latency model's figures (issue 32, item 2).

The model streams each kernel's bytes from DRAM (``mem_efficiency`` of its bandwidth) unless the
warps in flight bound them first; it does not know which tensors one kernel leaves in L2 for the
next (the report's rows do not say which buffers two kernels share). This script prices two
bounds instead of guessing, the fitted constants otherwise unchanged and not refitted:

* **bandwidth**: every streamed byte at L2's sustained rate (``Constants.l2_resident``:
  ``l2_efficiency`` of ``GPU.l2_bandwidth``, 6 TB/s against DRAM's 3.84 on an H200);
* **bandwidth and latency**: also every global access at an L2 hit's latency, ``LATENCY_RATIO``
  times shorter than DRAM's: ``warp_gbps`` that many times higher (Little's law),
  ``kstep_cycles`` and ``latency_us`` that many times lower, each kept inside its plausible range.

Residency saves at most the second (weights and model inputs still come from DRAM; so does
anything evicted). Priced on the 78 measured points (``souffle_experiments/latency_fit.py``'s: accuracy and
every point moved) and on the zoo at full size, TVM's build and the default's (v3,
time-driven), built for sm_90 with ptxas, under one CUDA graph.

Writes ``results/l2-residency-<date>/`` (``l2.json``, ``README.md``). All figures are ESTIMATES.

    .venv/bin/python -m souffle_experiments l2-residency [--models bert mmoe] [--no-nvcc] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from souffle_tvm import zoo
from souffle_tvm.cost import hardware, latency
from souffle_tvm.pipeline.driver import compile as compile_model
from souffle_tvm.report import predicted

from . import latency_fit
from .paths import ROOT

BUILDS = (("tvm", "tvm", {"cuda_graph": True, "level": "v2"}), ("default", "souffle", {"level": "v3", "partitioner": "time"}))
MOVED = 1e-3     # a relative change below this is not a change
# an L2 hit against a DRAM access on Hopper: ~200 against ~600 cycles in published tables (the
# floors' LOAD_LATENCY_CYCLES is the 200); the ratio only sizes the bound
LATENCY_RATIO = 3.0


def bounds(c: latency.Constants = latency.FITTED) -> dict[str, latency.Constants]:
    """The two bounds of L2 residency on ``c`` (module docstring)."""
    def clamp(name: str, value: float) -> float:
        lo, hi = latency.RANGES[name]
        return min(max(value, lo), hi)

    bandwidth = replace(c, l2_resident=True)
    both = replace(bandwidth, warp_gbps=clamp("warp_gbps", c.warp_gbps * LATENCY_RATIO),
                   kstep_cycles=clamp("kstep_cycles", c.kstep_cycles / LATENCY_RATIO),
                   latency_us=clamp("latency_us", c.latency_us / LATENCY_RATIO))
    return {"bandwidth": bandwidth, "latency": both}


def measured_points(gpu: hardware.GPU, priced: dict[str, latency.Constants]) -> dict:
    """Accuracy on the measured totals under the fitted constants and each bound, and the points each moves."""
    points, _ = latency_fit.load_points()
    out = {"points": len(points), "fitted": latency_fit.accuracy(gpu, latency.FITTED, points)}
    base = [latency_fit.predict_ms(gpu, latency.FITTED, p) for p in points]
    for key, c in priced.items():
        moved = []
        for p, a in zip(points, base):
            b = latency_fit.predict_ms(gpu, c, p)
            if abs(b / a - 1) > MOVED:
                moved.append({"run": p["run"], "id": p["id"], "graphs": p["graphs"], "measured_ms": p["measured_ms"],
                              "predicted_ms": round(a, 4), "bound_ms": round(b, 4)})
        out[key] = latency_fit.accuracy(gpu, c, points) | {"moved": moved}
    return out


def zoo_model(name: str, gpu: hardware.GPU, priced: dict[str, latency.Constants], nvcc: bool) -> list[dict]:
    """Each build of ``name`` (full size): graph ms under the fitted constants and each bound, and
    the kernels the larger bound moves most."""
    dtype = zoo.MODELS[name].paper_dtype
    rows = []
    for key, fusion, extra in BUILDS:
        t = time.perf_counter()
        c = compile_model(name, "cuda", fusion, arch=gpu.arch, small=False, dtype=dtype, nvcc=nvcc, **extra)
        kernels = predicted.kernels_of(c.report)
        a = latency.predict(gpu, latency.FITTED, kernels, graphs=True)
        row = {"model": name, "dtype": dtype, "build": key, "launches": c.report.launches,
               "graph_ms": round(a.seconds * 1e3, 4)}
        for bound, consts in priced.items():
            b = latency.predict(gpu, consts, kernels, graphs=True)
            saved = sorted(((k.launches * (x.seconds - y.seconds), k.name)
                            for k, x, y in zip(kernels, a.kernels, b.kernels)), reverse=True)
            row[bound] = {"graph_ms": round(b.seconds * 1e3, 4), "kernels_moved": sum(1 for s, _ in saved if s > 0),
                          "most": [{"name": n, "saved_us": round(s * 1e6, 3)} for s, n in saved[:3] if s > 0]}
        row["seconds"] = round(time.perf_counter() - t, 1)
        rows.append(row)
        print(f"  {name} {key}: {row['graph_ms']} ms; " + "; ".join(
            f"{b}: {row[b]['graph_ms']} ({row[b]['kernels_moved']} kernels moved)" for b in priced)
            + f" ({row['seconds']} s)", flush=True)
    return rows


def markdown(result: dict) -> str:
    m = result["measured"]
    out = [f"# L2 residency between kernels: the most it could change ({result['date']})", "",
           f"`python -m souffle_experiments l2-residency` at {result['commit']}, the fitted constants (`latency.FITTED`) otherwise "
           "unchanged and not refitted. Two bounds: **bandwidth**, every streamed byte at L2's sustained rate "
           f"({result['l2_tbps']:.2f} TB/s) instead of DRAM's ({result['dram_tbps']:.2f} TB/s); **latency**, that and "
           f"every global access at an L2 hit's latency, {result['latency_ratio']:g}x shorter than DRAM's "
           f"(warp_gbps {result['bounds']['latency']['warp_gbps']:.3g} GB/s, kstep_cycles "
           f"{result['bounds']['latency']['kstep_cycles']:.4g}, latency_us {result['bounds']['latency']['latency_us']:.3g}, "
           "each inside its plausible range, `latency.RANGES`). Real residency saves less: weights and inputs still come from "
           "DRAM. Every figure is a latency-model ESTIMATE.", "",
           f"## The {m['points']} measured points", "",
           "| pricing | median abs error | souffle-vs-TVM order right | points moved > 0.1% |", "|---|---|---|---|",
           f"| fitted | {m['fitted']['median_abs_error']:.1%} | {m['fitted']['signs_right']} of {m['fitted']['pairs']} | |"]
    for key in result["bounds"]:
        b = m[key]
        out.append(f"| {key} bound | {b['median_abs_error']:.1%} | {b['signs_right']} of {b['pairs']} | {len(b['moved'])} |")
    out += ["", "## The zoo at full size, under one CUDA graph", "",
            "| model | build | launches | predicted ms | bandwidth bound | change | latency bound | change | kernels moved (latency) | moved most (us saved per inference) |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["zoo"]:
        bw, lat = r["bandwidth"], r["latency"]
        most = ", ".join(f"`{k['name']}` {k['saved_us']}" for k in lat["most"]) or "-"
        out.append(f"| {r['model']} | {r['build']} | {r['launches']} | {r['graph_ms']} | {bw['graph_ms']} | "
                   f"{bw['graph_ms'] / r['graph_ms'] - 1:+.1%} | {lat['graph_ms']} | {lat['graph_ms'] / r['graph_ms'] - 1:+.1%} | "
                   f"{lat['kernels_moved']} | {most} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="*", default=zoo.names())
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--no-nvcc", action="store_true", help="skip ptxas (no register figures: occupancy guessed)")
    ap.add_argument("--out", default=None, help="output folder (default results/l2-residency-<date>)")
    args = ap.parse_args(argv)
    gpu = hardware.for_arch(args.arch)
    priced = bounds()
    date = datetime.date.today().isoformat()
    out = Path(args.out or ROOT / "results" / f"l2-residency-{date}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    result = {"date": date, "commit": commit, "gpu": gpu.name,
              "dram_tbps": gpu.dram_bandwidth * latency.FITTED.mem_efficiency / 1e12,
              "l2_tbps": gpu.l2_bandwidth * latency.FITTED.l2_efficiency / 1e12,
              "latency_ratio": LATENCY_RATIO, "bounds": {k: c.as_dict() for k, c in priced.items()},
              "measured": measured_points(gpu, priced), "zoo": []}
    for i, name in enumerate(args.models):
        print(f"[{i + 1}/{len(args.models)}] {name}", flush=True)
        result["zoo"] += zoo_model(name, gpu, priced, not args.no_nvcc)
    out.mkdir(parents=True, exist_ok=True)
    (out / "l2.json").write_text(json.dumps(result, indent=1))
    (out / "README.md").write_text(markdown(result))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
