"""Swin Transformer (Swin-B: embed 128, depths [2, 2, 18, 2], heads [4, 8, 16, 32], window 7, 224x224).

Written as the torchvision/timm code exports: Slice+Concat for torch.roll, Reshape/Transpose
window partitions, a Gather from the relative-position table, a constant shift mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .builder import GraphBuilder


@dataclass(frozen=True)
class SwinConfig:
    embed: int = 128
    depths: tuple[int, ...] = (2, 2, 18, 2)
    heads: tuple[int, ...] = (4, 8, 16, 32)
    window: int = 7
    image: int = 224
    patch: int = 4
    classes: int = 1000
    batch: int = 1


FULL = SwinConfig()
SMALL = SwinConfig(embed=32, depths=(2, 2), heads=(2, 4), window=4, image=64, classes=10)


def relative_position_index(w: int) -> np.ndarray:
    coords = np.stack(np.meshgrid(np.arange(w), np.arange(w), indexing="ij")).reshape(2, -1)
    rel = (coords[:, :, None] - coords[:, None, :]).transpose(1, 2, 0) + (w - 1)
    return (rel[..., 0] * (2 * w - 1) + rel[..., 1]).reshape(-1).astype(np.int64)


def shift_mask(res: int, w: int, s: int) -> np.ndarray:
    """The additive mask (nW, N, N) that stops shifted windows attending across image edges."""
    img = np.zeros((res, res))
    cnt = 0
    for hs in (slice(0, -w), slice(-w, -s), slice(-s, None)):
        for ws in (slice(0, -w), slice(-w, -s), slice(-s, None)):
            img[hs, ws] = cnt
            cnt += 1
    win = img.reshape(res // w, w, res // w, w).transpose(0, 2, 1, 3).reshape(-1, w * w)
    return np.where(win[:, None, :] != win[:, :, None], -100.0, 0.0)


def roll(g: GraphBuilder, x: str, shift: int, axis: int, size: int) -> str:
    """torch.roll(x, shift, axis) as the exporter writes it: two Slices and a Concat."""
    k = shift % size
    tail = g.op("Slice", [x, g.ints([size - k]), g.ints([size]), g.ints([axis])])
    head = g.op("Slice", [x, g.ints([0]), g.ints([size - k]), g.ints([axis])])
    return g.op("Concat", [tail, head], axis=axis)


def window_attention(g: GraphBuilder, x: str, nwin: int, n: int, dim: int, heads: int, w: int,
                     mask: np.ndarray | None) -> str:
    b = nwin
    dh = dim // heads
    qkv = g.transpose(g.reshape(g.linear(x, dim, 3 * dim), [b, n, 3, heads, dh]), [2, 0, 3, 1, 4])
    q, k, v = (g.op("Gather", [qkv, g.const(np.asarray(i, dtype=np.int64), "idx")], axis=0) for i in range(3))
    q = g.op("Mul", [q, g.scalar(dh ** -0.5)])
    attn = g.op("MatMul", [q, g.transpose(k, [0, 1, 3, 2])])
    table = g.const((0.02 * g.rng.standard_normal(((2 * w - 1) ** 2, heads))).astype(g.dtype), "rpb_table")
    bias = g.op("Gather", [table, g.const(relative_position_index(w), "rpb_index")], axis=0)
    bias = g.op("Unsqueeze", [g.transpose(g.reshape(bias, [n, n, heads]), [2, 0, 1]), g.ints([0])])
    attn = g.op("Add", [attn, bias])
    if mask is not None:
        nw = mask.shape[0]
        attn = g.reshape(attn, [b // nw, nw, heads, n, n])
        attn = g.op("Add", [attn, g.const(mask[None, :, None].astype(g.dtype), "shift_mask")])
        attn = g.reshape(attn, [b, heads, n, n])
    attn = g.op("Softmax", [attn], axis=-1)
    out = g.reshape(g.transpose(g.op("MatMul", [attn, v]), [0, 2, 1, 3]), [b, n, dim])
    return g.linear(out, dim, dim)


def block(g: GraphBuilder, x: str, res: int, dim: int, heads: int, w: int, shift: int, batch: int) -> str:
    n, nw = w * w, (res // w) ** 2
    y = g.reshape(g.layer_norm(x, dim), [batch, res, res, dim])
    if shift:
        y = roll(g, roll(g, y, -shift, 1, res), -shift, 2, res)
    y = g.reshape(y, [batch, res // w, w, res // w, w, dim])
    y = g.reshape(g.transpose(y, [0, 1, 3, 2, 4, 5]), [batch * nw, n, dim])
    y = window_attention(g, y, batch * nw, n, dim, heads, w, shift_mask(res, w, shift) if shift else None)
    y = g.reshape(y, [batch, res // w, res // w, w, w, dim])
    y = g.reshape(g.transpose(y, [0, 1, 3, 2, 4, 5]), [batch, res, res, dim])
    if shift:
        y = roll(g, roll(g, y, shift, 1, res), shift, 2, res)
    x = g.op("Add", [x, g.reshape(y, [batch, res * res, dim])])
    mlp = g.linear(g.gelu(g.linear(g.layer_norm(x, dim), dim, 4 * dim)), 4 * dim, dim)
    return g.op("Add", [x, mlp])


def patch_merging(g: GraphBuilder, x: str, res: int, dim: int, batch: int) -> str:
    y = g.reshape(x, [batch, res, res, dim])
    parts = []
    for r0, c0 in ((0, 0), (1, 0), (0, 1), (1, 1)):
        parts.append(g.op("Slice", [y, g.ints([r0, c0]), g.ints([res, res]), g.ints([1, 2]), g.ints([2, 2])]))
    y = g.reshape(g.op("Concat", parts, axis=-1), [batch, (res // 2) ** 2, 4 * dim])
    y = g.layer_norm(y, 4 * dim)
    return g.op("MatMul", [y, g.weight([4 * dim, 2 * dim], fan_in=4 * dim)])


def build(c: SwinConfig, dtype: str = "float32", seed: int = 0):
    g = GraphBuilder("swin", dtype, seed)
    x = g.input("image", [c.batch, 3, c.image, c.image])
    res, dim = c.image // c.patch, c.embed
    y = g.op("Conv", [x, g.weight([dim, 3, c.patch, c.patch], fan_in=3 * c.patch ** 2), g.bias(dim)],
             kernel_shape=[c.patch] * 2, strides=[c.patch] * 2)
    y = g.layer_norm(g.transpose(g.reshape(y, [c.batch, dim, res * res]), [0, 2, 1]), dim)
    for stage, (depth, heads) in enumerate(zip(c.depths, c.heads)):
        w = min(c.window, res)
        for i in range(depth):
            shift = w // 2 if (i % 2 == 1 and res > c.window) else 0
            y = block(g, y, res, dim, heads, w, shift, c.batch)
        if stage < len(c.depths) - 1:
            y = patch_merging(g, y, res, dim, c.batch)
            res, dim = res // 2, dim * 2
    y = g.op("ReduceMean", [g.layer_norm(y, dim)], axes=[1], keepdims=0)
    y = g.gemm(y, dim, c.classes)
    g.nodes[-1].output[0] = "logits"
    g.output("logits", [c.batch, c.classes])
    return g.model(f"Swin {c}")
