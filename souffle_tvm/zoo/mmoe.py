"""MMoE: multi-gate mixture of experts (input 100, units 16, 8 experts, 2 tasks)."""

from __future__ import annotations

from dataclasses import dataclass

from .builder import GraphBuilder


@dataclass(frozen=True)
class MMoEConfig:
    features: int = 100
    units: int = 16
    experts: int = 8
    tasks: int = 2
    tower: int = 8
    batch: int = 1


FULL = MMoEConfig()
SMALL = MMoEConfig(features=32, units=8, experts=4, tasks=2, tower=4)


def build(c: MMoEConfig, dtype: str = "float32", seed: int = 0):
    g = GraphBuilder("mmoe", dtype, seed)
    x = g.input("features", [c.batch, c.features])
    # One Gemm per expert, as a torch ModuleList of experts exports.
    experts = [g.op("Relu", [g.gemm(x, c.features, c.units)]) for _ in range(c.experts)]
    stacked = g.op("Concat", [g.op("Unsqueeze", [e, g.ints([1])]) for e in experts], axis=1)
    for t in range(c.tasks):
        gate = g.op("Softmax", [g.gemm(x, c.features, c.experts)], axis=-1)
        mixed = g.op("ReduceSum", [g.op("Mul", [stacked, g.op("Unsqueeze", [gate, g.ints([2])])]),
                                   g.ints([1])], keepdims=0)
        hidden = g.op("Relu", [g.gemm(mixed, c.units, c.tower)])
        g.op("Sigmoid", [g.gemm(hidden, c.tower, 1)])
        g.nodes[-1].output[0] = f"task{t}"
        g.output(f"task{t}", [c.batch, 1])
    return g.model(f"MMoE {c}")
