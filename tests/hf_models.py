"""Today's architectures as users export them (issue 58, item 3): ``transformers`` models built
from small configs with random weights (nothing is downloaded), plus the recurrent and
mixture-of-experts shapes users write in plain PyTorch, exported to ONNX at fixed shapes by
PyTorch's exporters. Exports are cached per torch and transformers version (``export``).

Which exporter: the legacy one (TorchScript) where it works, else the dynamo one (``EXPORTER``):
today's torch fails the legacy export of the decoder-only models (``unordered_map::at``), and
the dynamo export of data-dependent routing (Mixtral's) fails, so the MoE here is the dense
top-k form both exporters take.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import os
import warnings
from dataclasses import dataclass

import numpy as np
import torch
import transformers
from torch import nn

SEQ = 16
VOCAB = 100


class LastHidden(nn.Module):
    """A transformers model returning its last hidden state only (one output, no cache)."""

    def __init__(self, model: nn.Module, **kwargs):
        super().__init__()
        self.model, self.kwargs = model, kwargs

    def forward(self, x):
        out = self.model(x, **self.kwargs)
        return out.last_hidden_state


class SpeechGRU(nn.Module):
    """A speech encoder: a strided convolution over filterbank features, a two-layer bidirectional
    GRU over the 16 frames it leaves, a per-frame classifier."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(40, 32, 3, stride=2, padding=1)
        self.gru = nn.GRU(32, 32, num_layers=2, batch_first=True, bidirectional=True)
        self.out = nn.Linear(64, 20)

    def forward(self, x):
        return self.out(self.gru(torch.relu(self.conv(x)).transpose(1, 2))[0])


class LSTMLanguageModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.lstm = nn.Embedding(VOCAB, 32), nn.LSTM(32, 32, num_layers=2, batch_first=True)
        self.out = nn.Linear(32, VOCAB)

    def forward(self, x):
        return self.out(self.lstm(self.emb(x))[0])


class TopKMoE(nn.Module):
    """A mixture-of-experts layer in the dense top-k form: softmax router, top-2 renormalised,
    every expert on every token, weighted by the gate (zero off the top k)."""

    def __init__(self, d: int = 64, experts: int = 4, k: int = 2):
        super().__init__()
        self.router, self.k = nn.Linear(d, experts), k
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
                                     for _ in range(experts))
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        probs = torch.softmax(self.router(x), -1)
        w, idx = torch.topk(probs, self.k, -1)
        gate = torch.zeros_like(probs).scatter(-1, idx, w / w.sum(-1, keepdim=True))
        return self.norm(x + sum(gate[..., i:i + 1] * e(x) for i, e in enumerate(self.experts)))


class MoENet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.l1, self.l2 = nn.Embedding(VOCAB, 64), TopKMoE(), TopKMoE()

    def forward(self, x):
        return self.l2(self.l1(self.emb(x)))


def _llama():
    return LastHidden(transformers.LlamaModel(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64)), use_cache=False)


def _gpt2():
    return LastHidden(transformers.GPT2Model(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64)), use_cache=False)


def _t5():
    return LastHidden(transformers.T5EncoderModel(transformers.T5Config(
        vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4)))


def _wav2vec2():
    return LastHidden(transformers.Wav2Vec2Model(transformers.Wav2Vec2Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, conv_dim=(32, 32),
        conv_stride=(5, 2), conv_kernel=(10, 3), num_feat_extract_layers=2, num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4)))


def _convnext():
    return LastHidden(transformers.ConvNextModel(transformers.ConvNextConfig(
        num_channels=3, hidden_sizes=[16, 32], depths=[1, 1], num_stages=2, image_size=32)))


def _mobilenetv2():
    return LastHidden(transformers.MobileNetV2Model(transformers.MobileNetV2Config(image_size=32,
                                                                                   depth_multiplier=0.25)))


def _regnety():
    return LastHidden(transformers.RegNetModel(transformers.RegNetConfig(
        hidden_sizes=[16, 32], depths=[1, 1], groups_width=8, layer_type="y", embedding_size=16)))


def _deit():
    return LastHidden(transformers.DeiTModel(transformers.DeiTConfig(
        image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128)))


@dataclass(frozen=True)
class Arch:
    make: object
    input: str
    shape: tuple[int, ...]
    dtype: str
    exporter: str = "legacy"


ARCHS = {
    "llama": Arch(_llama, "input_ids", (1, SEQ), "int64", "dynamo"),       # causal mask, rotary, GQA
    "gpt2": Arch(_gpt2, "input_ids", (1, SEQ), "int64", "dynamo"),
    "t5": Arch(_t5, "input_ids", (1, SEQ), "int64"),                       # relative position bias
    "wav2vec2": Arch(_wav2vec2, "input_values", (1, 1600), "float32"),     # convolutional front-end
    "convnext": Arch(_convnext, "pixel_values", (1, 3, 32, 32), "float32"),
    "mobilenetv2": Arch(_mobilenetv2, "pixel_values", (1, 3, 32, 32), "float32"),
    "regnety": Arch(_regnety, "pixel_values", (1, 3, 32, 32), "float32"),
    "deit": Arch(_deit, "pixel_values", (1, 3, 32, 32), "float32"),
    "speech_gru": Arch(SpeechGRU, "features", (1, 40, 32), "float32"),     # bidirectional GRU, 16 frames
    "lstm_lm": Arch(LSTMLanguageModel, "input_ids", (1, SEQ), "int64"),
    "moe": Arch(MoENet, "input_ids", (1, SEQ), "int64"),
}


def example_input(name: str, seed: int = 0) -> dict[str, np.ndarray]:
    a = ARCHS[name]
    rng = np.random.default_rng(seed)
    value = rng.integers(0, VOCAB, a.shape) if a.dtype == "int64" else rng.standard_normal(a.shape)
    return {a.input: value.astype(a.dtype)}


def _export(name: str, path: str) -> None:
    a = ARCHS[name]
    torch.manual_seed(0)
    model = a.make().eval()
    args = tuple(torch.from_numpy(v) for v in example_input(name).values())
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), torch.no_grad():
        warnings.simplefilter("ignore")
        if a.exporter == "legacy":
            torch.onnx.export(model, args, path, input_names=[a.input], output_names=["out"], opset_version=17,
                              dynamo=False)
        else:
            torch.onnx.export(model, args, path, input_names=[a.input], output_names=["out"], dynamo=True,
                              verbose=False)


def export(name: str) -> str:
    """Path of ``name`` exported (once per torch and transformers version and this file)."""
    with open(__file__, "rb") as f:
        key = hashlib.sha256(f.read() + torch.__version__.encode() + transformers.__version__.encode()).hexdigest()[:12]
    root = os.environ.get("SOUFFLE_EXPORT_CACHE", os.path.expanduser("~/.cache/souffle-tvm/exports"))
    folder = os.path.join(root, f"hf-{key}")
    path = os.path.join(folder, f"{name}.onnx")
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.tmp"
        os.makedirs(tmp, exist_ok=True)
        _export(name, os.path.join(tmp, os.path.basename(path)))
        for f in sorted(os.listdir(tmp), key=lambda f: f.endswith(".onnx")):
            os.replace(os.path.join(tmp, f), os.path.join(folder, f))
        os.rmdir(tmp)
    return path
