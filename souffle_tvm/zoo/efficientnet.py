"""EfficientNet-B0 (224x224): MBConv blocks with depthwise convs, squeeze-excite and SiLU."""

from __future__ import annotations

from dataclasses import dataclass

from .builder import GraphBuilder

# (expand ratio, channels, repeats, stride, kernel) per stage, as in the B0 paper table.
B0_STAGES = ((1, 16, 1, 1, 3), (6, 24, 2, 2, 3), (6, 40, 2, 2, 5), (6, 80, 3, 2, 3),
             (6, 112, 3, 1, 5), (6, 192, 4, 2, 5), (6, 320, 1, 1, 3))


@dataclass(frozen=True)
class EfficientNetConfig:
    stages: tuple[tuple[int, int, int, int, int], ...] = B0_STAGES
    image: int = 224
    stem: int = 32
    head: int = 1280
    classes: int = 1000
    batch: int = 1


FULL = EfficientNetConfig()
SMALL = EfficientNetConfig(stages=((1, 8, 1, 1, 3), (6, 12, 2, 2, 3), (6, 16, 1, 2, 5)),
                           image=32, stem=8, head=64, classes=10)


def mbconv(g: GraphBuilder, x: str, c_in: int, c_out: int, expand: int, stride: int, k: int) -> str:
    mid = c_in * expand
    y = g.silu(g.conv(x, c_in, mid, 1)) if expand != 1 else x
    y = g.silu(g.conv(y, mid, mid, k, stride=stride, group=mid))
    # Squeeze-and-excite: a quarter of the block's input channels, at least one.
    se = max(1, c_in // 4)
    s = g.op("GlobalAveragePool", [y])
    s = g.op("Sigmoid", [g.conv(g.silu(g.conv(s, mid, se, 1)), se, mid, 1)])
    y = g.conv(g.op("Mul", [y, s]), mid, c_out, 1)
    if stride == 1 and c_in == c_out:
        y = g.op("Add", [y, x])
    return y


def build(c: EfficientNetConfig, dtype: str = "float32", seed: int = 0):
    g = GraphBuilder("efficientnet", dtype, seed)
    x = g.input("image", [c.batch, 3, c.image, c.image])
    y = g.silu(g.conv(x, 3, c.stem, 3, stride=2))
    ch = c.stem
    for expand, c_out, repeats, stride, k in c.stages:
        for i in range(repeats):
            y = mbconv(g, y, ch, c_out, expand, stride if i == 0 else 1, k)
            ch = c_out
    y = g.silu(g.conv(y, ch, c.head, 1))
    y = g.op("Flatten", [g.op("GlobalAveragePool", [y])], axis=1)
    y = g.gemm(y, c.head, c.classes)
    g.nodes[-1].output[0] = "logits"
    g.output("logits", [c.batch, c.classes])
    return g.model(f"EfficientNet {c}")


