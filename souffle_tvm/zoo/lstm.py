"""Stacked LSTM (10 layers, 100 time steps, hidden 256) as PyTorch exports nn.LSTM:
one ONNX ``LSTM`` node per layer (gates in ONNX's i, o, f, c order), a Squeeze between layers."""

from __future__ import annotations

from dataclasses import dataclass


from .builder import GraphBuilder


@dataclass(frozen=True)
class LSTMConfig:
    layers: int = 10
    steps: int = 100
    hidden: int = 256
    features: int = 256
    batch: int = 1


FULL = LSTMConfig()
SMALL = LSTMConfig(layers=2, steps=8, hidden=16, features=16, batch=2)


def lstm_layer(g: GraphBuilder, x: str, d_in: int, hidden: int, directions: int = 1,
               with_state: bool = True, batch: int = 1) -> list[str]:
    """One ONNX LSTM node; returns its three outputs (Y, Y_h, Y_c)."""
    w = g.weight([directions, 4 * hidden, d_in], fan_in=hidden)
    r = g.weight([directions, 4 * hidden, hidden], fan_in=hidden)
    b = g.const((0.1 * g.rng.standard_normal((directions, 8 * hidden))).astype(g.dtype), "lstm_b")
    inputs = [x, w, r, b]
    if with_state:
        h0 = g.const((0.1 * g.rng.standard_normal((directions, batch, hidden))).astype(g.dtype), "h0")
        c0 = g.const((0.1 * g.rng.standard_normal((directions, batch, hidden))).astype(g.dtype), "c0")
        inputs += ["", h0, c0]
    direction = {1: "forward", 2: "bidirectional"}[directions]
    return g.op("LSTM", inputs, n_out=3, hidden_size=hidden, direction=direction)


def build(c: LSTMConfig, dtype: str = "float32", seed: int = 0):
    g = GraphBuilder("lstm", dtype, seed)
    x = g.input("sequence", [c.steps, c.batch, c.features])
    d_in = c.features
    for _ in range(c.layers):
        y, _h, _c = lstm_layer(g, x, d_in, c.hidden, batch=c.batch)
        x = g.op("Squeeze", [y, g.ints([1])])
        d_in = c.hidden
    g.nodes[-1].output[0] = "output"
    g.output("output", [c.steps, c.batch, c.hidden])
    return g.model(f"LSTM {c}")


