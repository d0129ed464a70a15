"""One full-size LSTM layer (100 steps, hidden 256): launches, analytic and counted bytes (GPU
emulator), predicted graph time and floors, for TVM, the rolled v3 kernel and the default.

    .venv/bin/python -m souffle_experiments lstm-layer-counted OUT.json [--redo]

A spec of the experiment runner (``runner``): one model, three builds, each build's figures a
cell of ``OUT.json`` (``{build: figures}``), written as each build finishes; the builds already
there are kept unless ``--redo``. No table or plot: results/lstm-layer-counted-2026-12-07/README.md
tabulates them by hand.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

from . import runner

BUILDS = {"tvm": dict(fusion="tvm"), "v3 (rolled)": dict(fusion="souffle", level="v3"),
          "default": dict(fusion="souffle", level="auto")}
MODEL = "lstm layer"


@functools.cache
def layer():
    """The layer's ONNX model, built once: every build compiles the same one."""
    from souffle_tvm.zoo import lstm as lstm_zoo

    return lstm_zoo.build(lstm_zoo.LSTMConfig(layers=1, steps=100, hidden=256, features=256, batch=1))


def count(model, options: dict, _=None) -> dict:
    from souffle_tvm.pipeline import driver

    t = time.time()
    r = driver.compile(model(), "cuda", count_traffic=True, **options).report
    kr = r.kernels
    return {"launches": r.launches, "analytic_MB": r.bytes / 1e6,
            "counted_MB": (r.counted or {}).get("bytes", 0) / 1e6,
            "sector_MB": (r.counted or {}).get("sector_bytes", 0) / 1e6,
            "graph_ms": r.latency.get("graph_ms"),
            "pred_us": sum(k.launches * (k.predicted_us or 0) for k in kr),
            "floor_us": sum(k.launches * (k.floor_us or 0) for k in kr),
            "below_floor": sum(1 for k in kr if (k.predicted_us or 0) < (k.floor_us or 0) - 1e-9),
            "untimed": sum(1 for k in kr if k.measured_form is False), "kernels": len(kr),
            "fallback": r.fallback, "s": round(time.time() - t, 1)}


SPEC = runner.Spec("lstm-layer-counted", BUILDS, rows=lambda cells: cells.get(MODEL, {}), build=count,
                   progress=lambda m, b, r, _: f"{b} {r}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="the JSON file of the figures, {build: figures}")
    ap.add_argument("--redo", action="store_true", help="build every build again")
    args = ap.parse_args(argv)
    out = Path(args.out)
    runner.run(SPEC, out.parent, {MODEL: layer}, runner.JsonCells(out, "build", model=MODEL), redo=args.redo)
    return 0


if __name__ == "__main__":
    sys.exit(main())
