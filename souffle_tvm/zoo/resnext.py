"""ResNeXt-101 (32x4d, blocks [3, 4, 23, 3], 224x224), batch norm folded into the convolutions."""

from __future__ import annotations

from dataclasses import dataclass

from .builder import GraphBuilder


@dataclass(frozen=True)
class ResNeXtConfig:
    blocks: tuple[int, ...] = (3, 4, 23, 3)
    groups: int = 32
    width: int = 4
    image: int = 224
    stem: int = 64
    classes: int = 1000
    batch: int = 1


FULL = ResNeXtConfig()
SMALL = ResNeXtConfig(blocks=(1, 1, 1, 1), groups=4, width=2, image=32, stem=16, classes=10)


def bottleneck(g: GraphBuilder, x: str, c_in: int, planes: int, stride: int, c: ResNeXtConfig) -> tuple[str, int]:
    width = planes * c.width // c.stem * c.groups  # torchvision: int(planes * base_width / 64) * groups
    c_out = planes * 4
    y = g.op("Relu", [g.conv(x, c_in, width, 1)])
    y = g.op("Relu", [g.conv(y, width, width, 3, stride=stride, group=c.groups)])
    y = g.conv(y, width, c_out, 1)
    short = g.conv(x, c_in, c_out, 1, stride=stride) if (stride != 1 or c_in != c_out) else x
    return g.op("Relu", [g.op("Add", [y, short])]), c_out


def build(c: ResNeXtConfig, dtype: str = "float32", seed: int = 0):
    g = GraphBuilder("resnext", dtype, seed)
    x = g.input("image", [c.batch, 3, c.image, c.image])
    y = g.op("Relu", [g.conv(x, 3, c.stem, 7, stride=2, pad=3)])
    y = g.op("MaxPool", [y], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    ch = c.stem
    for stage, n in enumerate(c.blocks):
        planes = c.stem * 2**stage
        for i in range(n):
            y, ch = bottleneck(g, y, ch, planes, 2 if (i == 0 and stage > 0) else 1, c)
    y = g.op("Flatten", [g.op("GlobalAveragePool", [y])], axis=1)
    y = g.gemm(y, ch, c.classes)
    g.nodes[-1].output[0] = "logits"
    g.output("logits", [c.batch, c.classes])
    return g.model(f"ResNeXt {c}")
