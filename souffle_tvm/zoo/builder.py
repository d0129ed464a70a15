"""A small ONNX graph builder with seeded random weights.

The zoo models are written with it in the op forms that real exporters emit
(MatMul+Add, Gemm, Conv with folded batch norm, LayerNormalization, erf-GELU, ...).
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17

_ONNX_DTYPE = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}


class GraphBuilder:
    """Accumulates nodes and initializers; every weight comes from one seeded generator."""

    def __init__(self, name: str, dtype: str = "float32", seed: int = 0):
        if dtype not in _ONNX_DTYPE:
            raise ValueError(f"unsupported zoo dtype {dtype!r}; use float32 or float16")
        self.name = name
        self.dtype = dtype
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self._count: dict[str, int] = {}

    # -- naming ---------------------------------------------------------------------------
    def fresh(self, base: str) -> str:
        n = self._count.get(base, 0)
        self._count[base] = n + 1
        return f"{base}_{n}"

    # -- graph interface --------------------------------------------------------------------
    def input(self, name: str, shape: list[int], dtype: str | None = None) -> str:
        elem = _ONNX_DTYPE.get(dtype or self.dtype) if dtype != "int64" else TensorProto.INT64
        self.inputs.append(helper.make_tensor_value_info(name, elem, shape))
        return name

    def output(self, name: str, shape: list[int] | None = None) -> None:
        self.outputs.append(helper.make_tensor_value_info(name, _ONNX_DTYPE[self.dtype], shape))

    def const(self, array: np.ndarray, base: str = "c") -> str:
        name = self.fresh(base)
        self.inits.append(numpy_helper.from_array(np.array(array, order="C"), name))  # keeps 0-d scalars 0-d
        return name

    def ints(self, values, base: str = "shape") -> str:
        return self.const(np.asarray(values, dtype=np.int64), base)

    def scalar(self, value: float, base: str = "s") -> str:
        return self.const(np.asarray(value, dtype=self.dtype), base)

    def weight(self, shape, fan_in: int | None = None, base: str = "w") -> str:
        """Random weight scaled like a trained layer (std 1/sqrt(fan_in)) so activations stay O(1)."""
        fan_in = fan_in or int(shape[-1] if len(shape) < 2 else np.prod(shape[1:]))
        w = self.rng.standard_normal(shape) / math.sqrt(max(fan_in, 1))
        return self.const(w.astype(self.dtype), base)

    def bias(self, n: int, base: str = "b", scale: float = 0.1) -> str:
        return self.const((self.rng.standard_normal(n) * scale).astype(self.dtype), base)

    def op(self, op_type: str, inputs: list[str], n_out: int = 1, **attrs) -> str | list[str]:
        outs = [self.fresh(op_type.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=self.fresh(op_type), **attrs))
        return outs[0] if n_out == 1 else outs

    # -- layers, as exporters write them ------------------------------------------------------
    def linear(self, x: str, d_in: int, d_out: int) -> str:
        """torch.nn.Linear on a >2-D input: MatMul with W^T, then Add bias."""
        y = self.op("MatMul", [x, self.weight([d_in, d_out], fan_in=d_in)])
        return self.op("Add", [y, self.bias(d_out)])

    def gemm(self, x: str, d_in: int, d_out: int) -> str:
        """torch.nn.Linear on a 2-D input: Gemm with transB=1."""
        return self.op("Gemm", [x, self.weight([d_out, d_in], fan_in=d_in), self.bias(d_out)], transB=1)

    def layer_norm(self, x: str, dim: int) -> str:
        gamma = self.const((1 + 0.1 * self.rng.standard_normal(dim)).astype(self.dtype), "ln_g")
        return self.op("LayerNormalization", [x, gamma, self.bias(dim, "ln_b")], axis=-1, epsilon=1e-5)

    def gelu(self, x: str) -> str:
        """Exact GELU as torch exports it: x * 0.5 * (1 + erf(x / sqrt(2)))."""
        e = self.op("Erf", [self.op("Div", [x, self.scalar(math.sqrt(2.0))])])
        return self.op("Mul", [self.op("Mul", [x, self.op("Add", [e, self.scalar(1.0)])]), self.scalar(0.5)])

    def silu(self, x: str) -> str:
        return self.op("Mul", [x, self.op("Sigmoid", [x])])

    def conv(self, x: str, c_in: int, c_out: int, k: int, stride: int = 1, group: int = 1,
             pad: int | None = None) -> str:
        """Conv with its batch norm folded into weight and bias (what eval-mode exports give)."""
        pad = k // 2 if pad is None else pad
        w = self.weight([c_out, c_in // group, k, k], fan_in=(c_in // group) * k * k)
        return self.op("Conv", [x, w, self.bias(c_out)], kernel_shape=[k, k], strides=[stride, stride],
                       pads=[pad] * 4, group=group)

    def reshape(self, x: str, shape) -> str:
        return self.op("Reshape", [x, self.ints(shape)])

    def transpose(self, x: str, perm) -> str:
        return self.op("Transpose", [x], perm=list(perm))

    # -- result -------------------------------------------------------------------------------
    def model(self, doc: str = "") -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                                  producer_name="souffle-tvm-zoo")
        model.ir_version = 8
        model.doc_string = doc
        return model
