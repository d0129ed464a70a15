"""Stacked and bidirectional recurrences at --level v3 in three forms: the layer order (the
stitcher's waves off, as before them), the default (waves where independent chains exist) and
``--waves`` (step takes moved): kernels, grid syncs (the waits on the critical path), stages
and the stage loops each kernel writes out.

    python -m souffle_experiments waves-table [--out results/waves-<date>/waves.json]

No GPU and no build: what the stitcher decided (``pipeline.results.run``), for CUDA sm_90.
"""

from __future__ import annotations

import argparse
import json

from souffle_tvm.core.targets import make_target
from souffle_tvm.frontend.importer import import_onnx
from souffle_tvm.pipeline import results
from souffle_tvm.pipeline.options import Options
from souffle_tvm.stitch import kernel
from souffle_tvm.zoo import lstm

# (name, layers, steps, hidden): the paper's network is 10 x 100 x 256
STACKS = [("lstm 2x8 h16", 2, 8, 16), ("lstm 3x6 h256", 3, 6, 256), ("lstm 4x16 h64", 4, 16, 64),
          ("lstm 10x20 h256", 10, 20, 256)]


def _bidirectional(steps: int, hidden: int):
    """One bidirectional LSTM layer (its two directions are independent chains)."""
    from souffle_tvm.zoo.builder import GraphBuilder

    g = GraphBuilder("bilstm", "float32", 0)
    x = g.input("sequence", [steps, 1, hidden])
    lstm.lstm_layer(g, x, hidden, hidden, directions=2, batch=1)
    g.nodes[-1].output[0] = "output"
    g.output("output", [steps, 2, 1, hidden])
    return g.model("bidirectional LSTM")


def _row(name: str, model, waves: bool, order_kept: bool = False) -> dict:
    """``waves``: the option (step takes moved); ``order_kept``: the stitcher keeps the given
    order too (the build before waves existed)."""
    m = import_onnx(model)
    saved = kernel._by_waves
    if order_kept:
        kernel._by_waves = lambda *a, **kw: None
    try:
        s = results.run(m.mod, make_target("cuda", "sm_90"), m.params, Options(level="v3", waves=waves))
    finally:
        kernel._by_waves = saved
    form = ("layer order" if order_kept else "default" if not waves
            else "--waves" if s.options.waves else "--waves (fell back to the layer order)")
    return {"model": name, "form": form,
            "kernels": len(s.stitched), "grid syncs": sum(k.grid_syncs for k in s.stitched),
            "stages": sum(len(k.stages) for k in s.stitched),
            "written out": sum(k.written_out for k in s.stitched),
            "stages beside another lane": sum(1 for k in s.stitched for _, lane in k.phases if lane)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args(argv)
    rows = []
    for name, layers, steps, hidden in STACKS:
        model = lstm.build(lstm.LSTMConfig(layers=layers, steps=steps, hidden=hidden, features=hidden, batch=1))
        rows += [_row(name, model, False, order_kept=True), _row(name, model, False), _row(name, model, True)]
        print(f"{name}: done", flush=True)
    for steps, hidden in ((8, 64), (32, 256)):
        name = f"bidirectional lstm {steps} steps h{hidden}"
        rows += [_row(name, _bidirectional(steps, hidden), False, order_kept=True),
                 _row(name, _bidirectional(steps, hidden), False)]
        print(f"{name}: done", flush=True)
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |\n| " + " | ".join("---" for _ in keys) + " |")
    for r in rows:
        print("| " + " | ".join(str(r[k]) for k in keys) + " |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0
