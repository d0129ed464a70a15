"""Small PyTorch models in plain torch.nn (no torchvision) and their ONNX exports, cached on disk.

Each model is the structure of a real network at toy size, so the exporters emit what they
emit for the real one (shape arithmetic, grouped/depthwise convs, rolls, masks, RNN nodes)
while import, build and onnxruntime stay fast. Exports are written once per torch version
and source of this file to ``~/.cache/souffle-tvm/exports`` (override: SOUFFLE_EXPORT_CACHE).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import math
import os
import warnings
from dataclasses import dataclass

import logging

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

BATCH = 2


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.hd = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, bias=None):
        b, n, c = x.shape  # the legacy exporter turns these into Shape/Gather at run time
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, self.hd).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        att = (q @ k.transpose(-2, -1)) / math.sqrt(self.hd)
        if bias is not None:
            att = att + bias
        att = att.softmax(-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, n, c))


class EncoderLayer(nn.Module):
    def __init__(self, dim: int, heads: int, ff: int):
        super().__init__()
        self.att, self.ln1, self.ln2 = Attention(dim, heads), nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, ff), nn.GELU(), nn.Linear(ff, dim))

    def forward(self, x, bias=None):  # post-norm, as in BERT
        x = self.ln1(x + self.att(x, bias))
        return self.ln2(x + self.ff(x))


class Bert(nn.Module):
    """BERT encoder: word + position + token-type embeddings, attention mask, pooler."""

    def __init__(self, vocab=50, dim=32, heads=2, layers=2, max_len=16):
        super().__init__()
        self.word, self.pos, self.tok = nn.Embedding(vocab, dim), nn.Embedding(max_len, dim), nn.Embedding(2, dim)
        self.ln = nn.LayerNorm(dim)
        self.layers = nn.ModuleList(EncoderLayer(dim, heads, 2 * dim) for _ in range(layers))
        self.pool = nn.Linear(dim, dim)

    def forward(self, input_ids, attention_mask, token_type_ids):
        pos = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        x = self.ln(self.word(input_ids) + self.pos(pos) + self.tok(token_type_ids))
        bias = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * -10000.0
        for layer in self.layers:
            x = layer(x, bias)
        return x, torch.tanh(self.pool(x[:, 0]))


class HFBert(nn.Module):
    """BERT in the forms of transformers' BertModel (SDPA attention): position ids and token
    types from buffers sliced to the run-time length, and the 4-D mask of
    ``_prepare_4d_attention_mask_for_sdpa`` (expand to [b, 1, s, s], invert, masked_fill with
    the dtype's minimum). Exported, the Expand's shape is Shape arithmetic over ``input_ids``."""

    def __init__(self, vocab=50, dim=32, heads=2, layers=2, max_len=16):
        super().__init__()
        self.word, self.pos, self.tok = nn.Embedding(vocab, dim), nn.Embedding(max_len, dim), nn.Embedding(2, dim)
        self.register_buffer("position_ids", torch.arange(max_len).expand((1, -1)), persistent=False)
        self.ln = nn.LayerNorm(dim)
        self.layers = nn.ModuleList(EncoderLayer(dim, heads, 2 * dim) for _ in range(layers))
        self.pool = nn.Linear(dim, dim)

    def forward(self, input_ids, attention_mask, token_type_ids):
        b, s = input_ids.size()
        x = self.ln(self.word(input_ids) + self.pos(self.position_ids[:, 0:s]) + self.tok(token_type_ids))
        inverted = 1.0 - attention_mask[:, None, None, :].expand(b, 1, s, s).to(x.dtype)
        bias = inverted.masked_fill(inverted.to(torch.bool), torch.finfo(x.dtype).min)
        for layer in self.layers:
            x = layer(x, bias)
        return x, torch.tanh(self.pool(x[:, 0]))


class ResNeXtBlock(nn.Module):
    def __init__(self, cin, cout, groups, width, stride):
        super().__init__()
        mid = groups * width
        self.body = nn.Sequential(
            nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU(),
            nn.Conv2d(mid, mid, 3, stride, 1, groups=groups, bias=False), nn.BatchNorm2d(mid), nn.ReLU(),
            nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.short = (nn.Identity() if stride == 1 and cin == cout else
                      nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)))

    def forward(self, x):
        return F.relu(self.body(x) + self.short(x))


class ResNeXt(nn.Module):
    """ResNeXt 32x4d at toy size: cardinality 8, group width 4."""

    def __init__(self, classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.blocks = nn.Sequential(ResNeXtBlock(16, 32, 8, 4, 1), ResNeXtBlock(32, 64, 8, 4, 2))
        self.fc = nn.Linear(64, classes)

    def forward(self, x):
        x = self.blocks(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class MBConv(nn.Module):
    def __init__(self, cin, cout, expand, stride):
        super().__init__()
        mid, se = cin * expand, max(1, cin // 4)
        self.expand = nn.Sequential(nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid), nn.SiLU()) \
            if expand != 1 else nn.Identity()
        self.dw = nn.Sequential(nn.Conv2d(mid, mid, 3, stride, 1, groups=mid, bias=False), nn.BatchNorm2d(mid), nn.SiLU())
        self.se = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(mid, se, 1), nn.SiLU(), nn.Conv2d(se, mid, 1), nn.Sigmoid())
        self.project = nn.Sequential(nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        h = self.dw(self.expand(x))
        h = self.project(h * self.se(h))
        return x + h if self.residual else h


class EfficientNet(nn.Module):
    """EfficientNet-B0's MBConv stages (depthwise conv, squeeze-excite, SiLU) at toy size."""

    def __init__(self, classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.SiLU())
        self.blocks = nn.Sequential(MBConv(16, 16, 1, 1), MBConv(16, 24, 6, 2), MBConv(24, 24, 6, 1))
        self.head = nn.Sequential(nn.Conv2d(24, 64, 1, bias=False), nn.BatchNorm2d(64), nn.SiLU())
        self.fc = nn.Linear(64, classes)

    def forward(self, x):
        x = self.head(self.blocks(self.stem(x)))
        return self.fc(x.mean((2, 3)))


def _windows(x, w):
    b, h, wd, c = x.shape
    x = x.view(b, h // w, w, wd // w, w, c).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(-1, w * w, c)


def _unwindows(x, w, b, h, wd):
    c = x.shape[-1]
    x = x.view(b, h // w, wd // w, w, w, c).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(b, h, wd, c)


class SwinBlock(nn.Module):
    def __init__(self, dim, heads, res, window, shift):
        super().__init__()
        self.res, self.window, self.shift = res, window, shift
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.att = Attention(dim, heads)
        self.rel = nn.Parameter(torch.randn(heads, window * window, window * window) * 0.02)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        if shift:  # Swin's mask: tokens that the roll brought together from far regions don't attend
            img = torch.zeros(1, res, res, 1)
            cuts = (slice(0, -window), slice(-window, -shift), slice(-shift, None))
            for k, (hs, ws) in enumerate((a, b) for a in cuts for b in cuts):
                img[:, hs, ws, :] = k
            ids = _windows(img, window).squeeze(-1)
            mask = (ids[:, None, :] != ids[:, :, None]).float() * -100.0
            self.register_buffer("mask", mask)
        else:
            self.mask = None

    def forward(self, x):  # x: [B, H, W, C], as in torchvision's Swin
        b, H, W, c = x.shape
        w = self.window
        # torchvision pads to whole windows with amounts computed from the run-time shape: the
        # legacy exporter writes them as Shape/Mod/Sub arithmetic feeding Pad.
        pad_r, pad_b = (w - W % w) % w, (w - H % w) % w
        h = F.pad(self.ln1(x), (0, 0, 0, pad_r, 0, pad_b))
        ph, pw = h.shape[1], h.shape[2]
        if self.shift:
            h = torch.roll(h, (-self.shift, -self.shift), (1, 2))
        win = _windows(h, w)
        bias = self.rel.unsqueeze(0)                                   # [1, heads, N, N]
        if self.mask is not None:                                      # per window: [b * nw, heads, N, N]
            bias = (bias + self.mask[:, None]).unsqueeze(0).expand(b, -1, -1, -1, -1)
            bias = bias.reshape(-1, *self.rel.shape)
        h = _unwindows(self.att(win, bias), w, b, ph, pw)
        if self.shift:
            h = torch.roll(h, (self.shift, self.shift), (1, 2))
        x = x + h[:, :H, :W, :].contiguous()
        return x + self.mlp(self.ln2(x))


class Swin(nn.Module):
    """Swin: patch embedding, a plain and a shifted window-attention block, mean pool."""

    def __init__(self, classes=10, dim=32):
        super().__init__()
        self.embed = nn.Conv2d(3, dim, 4, 4)
        self.blocks = nn.Sequential(SwinBlock(dim, 2, 8, 4, 0), SwinBlock(dim, 2, 8, 4, 2))
        self.ln, self.fc = nn.LayerNorm(dim), nn.Linear(dim, classes)

    def forward(self, x):
        x = self.embed(x).permute(0, 2, 3, 1)
        return self.fc(self.ln(self.blocks(x)).mean((1, 2)))


class ViT(nn.Module):
    """ViT: patch embedding, class token, learned positions, pre-norm encoder layers."""

    def __init__(self, classes=10, dim=32, layers=2):
        super().__init__()
        self.embed = nn.Conv2d(3, dim, 8, 8)
        self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, 17, dim) * 0.02)
        self.layers = nn.ModuleList(nn.ModuleDict({"ln1": nn.LayerNorm(dim), "att": Attention(dim, 2),
                                                   "ln2": nn.LayerNorm(dim), "mlp": nn.Sequential(
                                                       nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))})
                                    for _ in range(layers))
        self.ln, self.fc = nn.LayerNorm(dim), nn.Linear(dim, classes)

    def forward(self, x):
        x = self.embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1) + self.pos
        for m in self.layers:
            x = x + m["att"](m["ln1"](x))
            x = x + m["mlp"](m["ln2"](x))
        return self.fc(self.ln(x[:, 0]))


class ViT224(ViT):
    """ViT-B/16's patch embedding (16x16 stride-16 conv at 224x224: 196 patches) under one
    narrow pre-norm encoder layer: the shape class of a torchvision ViT at toy width."""

    def __init__(self, classes=10, dim=64, layers=1):
        super().__init__(classes, dim, layers)
        self.embed = nn.Conv2d(3, dim, 16, 16)
        self.pos = nn.Parameter(torch.randn(1, 197, dim) * 0.02)


def _cbl(cin: int, cout: int, k: int = 3) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, k, 1, k // 2, bias=False), nn.BatchNorm2d(cout), nn.LeakyReLU(0.1))


class Yolo(nn.Module):
    """A YOLOv3-tiny-style detector at 416x416: conv/MaxPool backbone, a CSP route through half
    the channels (Slice), an upsampled branch (Resize, nearest x2) concatenated with an earlier
    map, two detection heads."""

    def __init__(self, c=8, classes=3):
        super().__init__()
        self.b1 = nn.Sequential(_cbl(3, c), nn.MaxPool2d(2, 2), _cbl(c, 2 * c), nn.MaxPool2d(2, 2))
        self.b2 = nn.Sequential(_cbl(c, 2 * c), nn.MaxPool2d(2, 2))
        self.b3 = nn.Sequential(_cbl(2 * c, 4 * c), nn.MaxPool2d(2, 2), _cbl(4 * c, 4 * c))
        self.lat = _cbl(4 * c, 2 * c, 1)
        n = 3 * (5 + classes)
        self.head1 = nn.Conv2d(4 * c, n, 1)
        self.head2 = nn.Sequential(_cbl(4 * c, 2 * c), nn.Conv2d(2 * c, n, 1))

    def forward(self, x):
        f1 = self.b1(x)
        f2 = self.b2(f1[:, f1.shape[1] // 2:])
        f3 = self.b3(f2)
        up = F.interpolate(self.lat(f3), scale_factor=2, mode="nearest")
        return self.head1(f3), self.head2(torch.cat([up, f2], 1))


class ConvNeXtBlock(nn.Module):
    """ConvNeXt's block: a 7x7 depthwise convolution, LayerNorm over channels (channels last),
    an inverted MLP with GELU, a per-channel layer scale, the residual."""

    def __init__(self, dim: int):
        super().__init__()
        self.dw = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pw1, self.pw2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 0.5))

    def forward(self, x):
        y = self.dw(x).permute(0, 2, 3, 1)
        y = self.gamma * self.pw2(F.gelu(self.pw1(self.norm(y))))
        return x + y.permute(0, 3, 1, 2)


class ConvNeXt(nn.Module):
    """A ConvNeXt-style network: a 4x4 patchify stem, two blocks, pooled, normalised, classified."""

    def __init__(self, classes=10, dim=32):
        super().__init__()
        self.stem = nn.Conv2d(3, dim, 4, stride=4)
        self.blocks = nn.Sequential(ConvNeXtBlock(dim), ConvNeXtBlock(dim))
        self.norm, self.head = nn.LayerNorm(dim, eps=1e-6), nn.Linear(dim, classes)

    def forward(self, x):
        return self.head(self.norm(self.blocks(self.stem(x)).mean((2, 3))))


class LSTMClassifier(nn.Module):
    def __init__(self, features=8, hidden=16, classes=4):
        super().__init__()
        self.rnn = nn.LSTM(features, hidden, num_layers=2, batch_first=True)
        self.fc = nn.Linear(hidden, classes)

    def forward(self, x):
        y, _ = self.rnn(x)
        return self.fc(y[:, -1])


class GRUNet(nn.Module):
    def __init__(self, features=8, hidden=12):
        super().__init__()
        self.rnn = nn.GRU(features, hidden, batch_first=True, bidirectional=True)

    def forward(self, x):
        y, h = self.rnn(x)
        return y, h


class MMoE(nn.Module):
    """Multi-gate mixture of experts: shared experts, one softmax gate and tower per task."""

    def __init__(self, features=16, experts=4, hidden=8, tasks=2):
        super().__init__()
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(features, hidden), nn.ReLU()) for _ in range(experts))
        self.gates = nn.ModuleList(nn.Linear(features, experts) for _ in range(tasks))
        self.towers = nn.ModuleList(nn.Sequential(nn.Linear(hidden, 4), nn.ReLU(), nn.Linear(4, 1)) for _ in range(tasks))

    def forward(self, x):
        e = torch.stack([m(x) for m in self.experts], 1)                  # [b, experts, hidden]
        outs = []
        for gate, tower in zip(self.gates, self.towers):
            w = gate(x).softmax(-1).unsqueeze(-1)
            outs.append(torch.sigmoid(tower((w * e).sum(1))))
        return tuple(outs)


@dataclass(frozen=True)
class Spec:
    """A model, its example inputs (batch axis 0 is exported dynamic) and its I/O names."""

    make: type
    inputs: dict        # name -> (shape, dtype)
    outputs: tuple[str, ...]


SEQ = 8
SPECS = {
    "bert": Spec(Bert, {"input_ids": ((BATCH, SEQ), "int64"), "attention_mask": ((BATCH, SEQ), "int64"),
                        "token_type_ids": ((BATCH, SEQ), "int64")}, ("hidden", "pooled")),
    "hfbert": Spec(HFBert, {"input_ids": ((BATCH, SEQ), "int64"), "attention_mask": ((BATCH, SEQ), "int64"),
                            "token_type_ids": ((BATCH, SEQ), "int64")}, ("hidden", "pooled")),
    "resnext": Spec(ResNeXt, {"x": ((BATCH, 3, 32, 32), "float32")}, ("logits",)),
    "efficientnet": Spec(EfficientNet, {"x": ((BATCH, 3, 32, 32), "float32")}, ("logits",)),
    "swin": Spec(Swin, {"x": ((BATCH, 3, 32, 32), "float32")}, ("logits",)),
    "convnext": Spec(ConvNeXt, {"x": ((BATCH, 3, 32, 32), "float32")}, ("logits",)),
    "vit": Spec(ViT, {"x": ((BATCH, 3, 32, 32), "float32")}, ("logits",)),
    "vit224": Spec(ViT224, {"x": ((BATCH, 3, 224, 224), "float32")}, ("logits",)),
    "yolo": Spec(Yolo, {"x": ((BATCH, 3, 416, 416), "float32")}, ("boxes13", "boxes26")),
    "lstm": Spec(LSTMClassifier, {"x": ((BATCH, SEQ, 8), "float32")}, ("logits",)),
    "gru": Spec(GRUNet, {"x": ((BATCH, SEQ, 8), "float32")}, ("y", "h")),
    "mmoe": Spec(MMoE, {"x": ((BATCH, 16), "float32")}, ("task0", "task1")),
}
EXPORTERS = ("legacy", "dynamo")
# Exports of the CNNs that keep inference BatchNormalization (EXPORTERS fold it into the convs)
BN_EXPORTERS = ("legacy-bn", "dynamo-bn")
BN_MODELS = ("resnext", "efficientnet")


def input_shapes(name: str, batch: int = BATCH, seq: int | None = None) -> dict[str, tuple[int, ...]]:
    """The model's input shapes at ``batch`` (and ``seq`` for axis 1, where given)."""
    return {key: (batch, *((seq,) + shape[2:] if seq else shape[1:])) for key, (shape, _) in SPECS[name].inputs.items()}


def example_inputs(name: str, seed: int = 0, batch: int = BATCH, seq: int | None = None) -> dict[str, np.ndarray]:
    """Seeded example inputs: ids within the vocabulary, a padding mask, token types, N(0,1) floats."""
    rng = np.random.default_rng(seed)
    out = {}
    for key, (_, dtype) in SPECS[name].inputs.items():
        shape = input_shapes(name, batch, seq)[key]
        if key == "input_ids":
            out[key] = rng.integers(0, 50, shape).astype(dtype)
        elif key == "attention_mask":
            out[key] = (np.arange(shape[1])[None, :] < rng.integers(2, shape[1] + 1, (shape[0], 1))).astype(dtype)
        elif key == "token_type_ids":
            out[key] = (np.arange(shape[1])[None, :] >= shape[1] // 2).repeat(shape[0], 0).astype(dtype)
        else:
            out[key] = rng.standard_normal(shape).astype(dtype)
    return out


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    model = SPECS[name].make().eval()
    with torch.no_grad():  # non-trivial BatchNorm statistics, so folding them is tested
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 1.5)
    return model


def _export(name: str, exporter: str, path: str) -> None:
    spec, model = SPECS[name], build(name)
    args = tuple(torch.from_numpy(a) for a in example_inputs(name).values())
    names, outs = list(spec.inputs), list(spec.outputs)
    # The dynamo exporter prints progress and warns about torchvision's absence; keep test logs clean.
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        # -seq: the sequence axis (1) dynamic too (dynamo: up to the models' 16 positions).
        # -bn: inference BatchNormalization kept; by default both exporters fold it into the conv
        # (legacy: constant folding; dynamo: onnxscript's optimizer, off also leaves its shape ops).
        if exporter in ("legacy", "legacy-seq", "legacy-bn"):
            axes = {0: "batch", 1: "seq"} if exporter == "legacy-seq" else {0: "batch"}
            torch.onnx.export(model, args, path, input_names=names, output_names=outs, opset_version=17,
                              dynamic_axes={n: axes for n in names}, dynamo=False,
                              do_constant_folding=exporter != "legacy-bn", training=torch.onnx.TrainingMode.EVAL)
        else:
            dims = {0: torch.export.Dim("batch", min=1, max=64)}
            if exporter == "dynamo-seq":
                dims[1] = torch.export.Dim("seq", min=2, max=16)
            torch.onnx.export(model, args, path, input_names=names, output_names=outs, dynamo=True,
                              dynamic_shapes=tuple(dims for _ in names), verbose=False,
                              optimize=exporter != "dynamo-bn")


def cache_dir() -> str:
    with open(__file__, "rb") as f:
        key = hashlib.sha256(f.read() + torch.__version__.encode()).hexdigest()[:12]
    root = os.environ.get("SOUFFLE_EXPORT_CACHE", os.path.expanduser("~/.cache/souffle-tvm/exports"))
    return os.path.join(root, f"torch-{torch.__version__}-{key}")


def export(name: str, exporter: str) -> str:
    """Path of ``name`` exported by ``exporter`` (legacy|dynamo, or either with -seq or -bn, see
    ``_export``), exporting it on first use."""
    path = os.path.join(cache_dir(), f"{name}-{exporter}.onnx")
    if not os.path.exists(path):
        # Export under the final file name in a private folder (the dynamo exporter writes the
        # weights beside the model, NAME.onnx.data, as users get them), then move the files in,
        # the model last: a concurrent or interrupted export never leaves half a model.
        tmp = f"{path}.{os.getpid()}.tmp"
        os.makedirs(tmp, exist_ok=True)
        _export(name, exporter, os.path.join(tmp, os.path.basename(path)))
        for f in sorted(os.listdir(tmp), key=lambda f: f.endswith(".onnx")):
            os.replace(os.path.join(tmp, f), os.path.join(os.path.dirname(path), f))
        os.rmdir(tmp)
    return path


# -- names in other exporters' styles -----------------------------------------------------------
# TF/Keras (tf2onnx) and JAX (jax2tf) name every tensor by its layer path; torch's legacy
# exporter's own names (``/layers.0/attn/Constant_3_output_0``, ``layers.0.attn.qkv.weight``)
# are kept as they are. Renaming a torch export gives the same graph under each exporter's names.
NAME_STYLES = ("torch", "tf", "jax")


def _styled(style: str, index: int, name: str, op: str, initializer: bool) -> str:
    name = name.replace("onnx::", "")   # "/layers.0/att/MatMul_output_0" or "layers.0.att.qkv.weight"
    parts = name.split("/")[1:-1] if "/" in name else name.split(".")[:-1]
    path = "/".join(parts).replace(".", "_") or "dense"
    if style == "tf":   # tf2onnx: the Keras layer path, the TF op, the output index
        return f"model/{path}_{index}/{'kernel' if initializer else op}:0"
    # jax2tf: one flat function scope; constants are Const_N. Pairs of names that differ only in
    # the characters C does not allow ("/" and ":") make the identifiers collide once sanitized.
    sep = "/" if index % 2 == 0 else ":"
    return f"jax2tf_fn_{sep}{'Const' if initializer else op}_{index // 2}"


def rename(model, style: str):
    """A copy of ``model`` with every tensor named in ``style`` (graph inputs and outputs too,
    except in the torch style, which is the export as it is)."""
    import onnx

    out = onnx.ModelProto()
    out.CopyFrom(model)
    if style == "torch":
        return out
    g = out.graph
    producers = {o: n.op_type for n in g.node for o in n.output}
    inits = [t.name for t in g.initializer]
    names = inits + [o for n in g.node for o in n.output if o and o not in inits]
    mapping = {n: _styled(style, i, n, producers.get(n, "Const"), n in inits) for i, n in enumerate(names)}
    for vi in g.input:
        if vi.name not in mapping:
            mapping[vi.name] = f"serving_default_{vi.name}:0" if style == "tf" else f"jax2tf_arg_{vi.name}:0"
    for k, vi in enumerate(g.output):
        mapping[vi.name] = f"StatefulPartitionedCall:{k}" if style == "tf" else f"jax2tf_fn_/Identity_{k}"
    assert len(set(mapping.values())) == len(mapping), "renaming must keep tensors apart"
    for t in g.initializer:
        t.name = mapping[t.name]
    for n in g.node:
        n.input[:] = [mapping.get(x, x) for x in n.input]
        n.output[:] = [mapping.get(x, x) for x in n.output]
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        vi.name = mapping.get(vi.name, vi.name)
    return out
