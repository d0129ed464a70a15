"""BERT-base encoder (the paper's configuration: batch 1, seq 384, 12 layers, fp16)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .builder import GraphBuilder


@dataclass(frozen=True)
class BertConfig:
    layers: int = 12
    seq: int = 384
    hidden: int = 768
    heads: int = 12
    ffn: int = 3072
    batch: int = 1


FULL = BertConfig()
SMALL = BertConfig(layers=2, seq=32, hidden=64, heads=2, ffn=128)


def attention(g: GraphBuilder, x: str, c: BertConfig) -> str:
    """Self-attention as torch exports nn.MultiheadAttention-free BERT code: per-head reshape/transpose."""
    b, s, h, nh = c.batch, c.seq, c.hidden, c.heads
    dh = h // nh

    def heads(t: str, perm) -> str:
        return g.transpose(g.reshape(t, [b, s, nh, dh]), perm)

    q = heads(g.linear(x, h, h), [0, 2, 1, 3])
    k = heads(g.linear(x, h, h), [0, 2, 3, 1])
    v = heads(g.linear(x, h, h), [0, 2, 1, 3])
    scores = g.op("Div", [g.op("MatMul", [q, k]), g.scalar(math.sqrt(dh))])
    probs = g.op("Softmax", [scores], axis=-1)
    ctx = g.reshape(g.transpose(g.op("MatMul", [probs, v]), [0, 2, 1, 3]), [b, s, h])
    return g.linear(ctx, h, h)


def encoder_layer(g: GraphBuilder, x: str, c: BertConfig) -> str:
    x = g.layer_norm(g.op("Add", [attention(g, x, c), x]), c.hidden)
    ff = g.linear(g.gelu(g.linear(x, c.hidden, c.ffn)), c.ffn, c.hidden)
    return g.layer_norm(g.op("Add", [ff, x]), c.hidden)


def build(c: BertConfig, dtype: str = "float32", seed: int = 0):
    g = GraphBuilder("bert", dtype, seed)
    x = g.input("hidden_states", [c.batch, c.seq, c.hidden])
    for _ in range(c.layers):
        x = encoder_layer(g, x, c)
    g.nodes[-1].output[0] = "output"
    g.output("output", [c.batch, c.seq, c.hidden])
    return g.model(f"BERT encoder {c}")
