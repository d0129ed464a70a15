"""Saved reports priced under the fitted constants and every leave-one-model-out set: does a
comparison between builds hold whatever the constants? (A prediction, not a measurement.)

    python -m souffle_experiments constant-sets before.json after.json [--markdown]
"""

from __future__ import annotations

import argparse
import json

from souffle_tvm.cost import hardware, latency, shipped


def price(report: dict, arch: str = "sm_90") -> dict:
    """One report's launches, grid syncs, analytic MB and predicted ms under a CUDA graph, per
    constant set (``fitted`` and each model left out of the fit)."""
    gpu = hardware.for_arch(report.get("arch") or arch)
    kernels = latency.kernels_from_rows(report["kernels"])
    sets = {"fitted": shipped.fitted(), **shipped.leave_one_model_out()}
    ms = {name: latency.predict(gpu, c, kernels, graphs=True).seconds * 1e3 for name, c in sets.items()}
    return {"launches": report["launches"], "grid_syncs": sum(k.get("grid_syncs") or 0 for k in report["kernels"]),
            "mb": report["bytes"] / 1e6, "ms": ms}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reports", nargs="+", help="report JSON files (compile --report)")
    args = ap.parse_args(argv)
    print("| report | launches | grid syncs | MB | fitted ms | lowest ms (set) | highest ms (set) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for path in args.reports:
        with open(path) as f:
            p = price(json.load(f))
        lo, hi = min(p["ms"], key=p["ms"].get), max(p["ms"], key=p["ms"].get)
        print(f"| {path} | {p['launches']} | {p['grid_syncs']} | {p['mb']:.2f} | {p['ms']['fitted']:.3f} | "
              f"{p['ms'][lo]:.3f} ({lo}) | {p['ms'][hi]:.3f} ({hi}) |")
    return 0
