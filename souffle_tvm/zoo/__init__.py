"""The six models of the Souffle paper, built as ONNX graphs with seeded random weights.

``build(name, small=False, dtype="float32")`` returns an ``onnx.ModelProto``; nothing is
downloaded. The full configurations are the paper artifact's; the small ones keep the same
structure at sizes that build and run on a CPU in seconds (they are what the tests use).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import onnx

from . import bert, efficientnet, lstm, mmoe, resnext, swin


@dataclass(frozen=True)
class ZooEntry:
    name: str
    module: ModuleType
    summary: str
    dtypes: tuple[str, ...] = ("float32",)
    paper_dtype: str = "float32"


MODELS: dict[str, ZooEntry] = {
    e.name: e
    for e in (
        ZooEntry("bert", bert, "BERT-base encoder: batch 1, seq 384, 12 layers, hidden 768, 12 heads",
                 ("float32", "float16"), "float16"),
        ZooEntry("resnext", resnext, "ResNeXt-101 32x4d: blocks [3,4,23,3], 224x224"),
        ZooEntry("lstm", lstm, "LSTM: 10 layers, 100 steps, hidden 256 (ONNX LSTM nodes)"),
        ZooEntry("efficientnet", efficientnet, "EfficientNet-B0: 224x224"),
        ZooEntry("swin", swin, "Swin-B: embed 128, depths [2,2,18,2], heads [4,8,16,32], window 7",
                 ("float32", "float16"), "float16"),
        ZooEntry("mmoe", mmoe, "MMoE: input 100, units 16, 8 experts, 2 tasks"),
    )
}


def names() -> list[str]:
    return list(MODELS)


def build(name: str, small: bool = False, dtype: str = "float32", seed: int = 0) -> onnx.ModelProto:
    """Build zoo model ``name`` (full or small variant) in ``dtype``."""
    if name not in MODELS:
        raise KeyError(f"unknown zoo model {name!r}; choose one of {', '.join(MODELS)}")
    entry = MODELS[name]
    if dtype not in entry.dtypes:
        raise ValueError(f"zoo model {name!r} is built in {', '.join(entry.dtypes)}, not {dtype}")
    config = entry.module.SMALL if small else entry.module.FULL
    return entry.module.build(config, dtype=dtype, seed=seed)
