"""Property test: 200 random small graphs keep their numerics through the Souffle pipeline.

Graphs are chains and diamonds of MatMul (+bias), Reshape, Transpose, Softmax,
LayerNormalization, ReduceSum/ReduceMean, element-wise ops and broadcasts, generated from a
seed (reproducible: a failure names its seed). Each is compiled with ``--fusion souffle`` for
llvm and compared with onnxruntime.
"""

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from souffle_tvm.runtime import runner
from souffle_tvm.pipeline.driver import compile as compile_model

N_GRAPHS = 200
PER_TEST = 25


class RandomGraph:
    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.nodes, self.inits, self.n = [], [], 0

    def name(self, base):
        self.n += 1
        return f"{base}{self.n}"

    def const(self, arr):
        nm = self.name("c")
        self.inits.append(numpy_helper.from_array(np.asarray(arr), nm))
        return nm

    def op(self, kind, inputs, **attrs):
        out = self.name(kind.lower())
        self.nodes.append(helper.make_node(kind, inputs, [out], **attrs))
        return out

    def step(self, x, shape):
        """Apply one random op to (x, shape) -> (y, new shape)."""
        r = self.rng
        choice = r.choice(["matmul", "reshape", "transpose", "softmax", "layernorm", "reduce", "elementwise",
                           "broadcast", "diamond"])
        if choice == "matmul":
            n = int(r.choice([4, 8, 12]))
            w = self.const((r.standard_normal((shape[-1], n)) / np.sqrt(shape[-1])).astype(np.float32))
            y = self.op("MatMul", [x, w])
            if r.random() < 0.7:
                y = self.op("Add", [y, self.const(r.standard_normal(n).astype(np.float32))])
            return y, shape[:-1] + [n]
        if choice == "reshape" and shape[-1] % 2 == 0:
            new = shape[:-1] + [2, shape[-1] // 2] if len(shape) < 4 else shape[:-2] + [shape[-2] * shape[-1]]
            return self.op("Reshape", [x, self.const(np.array(new, np.int64))]), new
        if choice == "transpose" and len(shape) >= 2:
            perm = list(range(len(shape)))
            perm[-1], perm[-2] = perm[-2], perm[-1]
            return self.op("Transpose", [x], perm=perm), [shape[p] for p in perm]
        if choice == "softmax":
            return self.op("Softmax", [x], axis=-1), shape
        if choice == "layernorm":
            g = self.const((1 + 0.1 * r.standard_normal(shape[-1])).astype(np.float32))
            b = self.const((0.1 * r.standard_normal(shape[-1])).astype(np.float32))
            return self.op("LayerNormalization", [x, g, b], axis=-1, epsilon=1e-5), shape
        if choice == "reduce" and len(shape) >= 3:
            kind = str(r.choice(["ReduceSum", "ReduceMean"]))
            if kind == "ReduceSum":
                return self.op(kind, [x, self.const(np.array([-2], np.int64))], keepdims=1), shape[:-2] + [1, shape[-1]]
            return self.op(kind, [x], axes=[-2], keepdims=1), shape[:-2] + [1, shape[-1]]
        if choice == "broadcast":
            row = self.const(r.standard_normal(shape[-1]).astype(np.float32))
            return self.op(str(r.choice(["Add", "Mul"])), [x, row]), shape
        if choice == "diamond":
            a = self.op("Relu", [x])
            b = self.op("Sigmoid", [x])
            return self.op(str(r.choice(["Add", "Mul", "Sub"])), [a, b]), shape
        act = str(r.choice(["Relu", "Tanh", "Sigmoid", "Erf", "Neg"]))
        return self.op(act, [x]), shape

    def build(self):
        shape = [1, int(self.rng.choice([4, 6, 8])), int(self.rng.choice([8, 12, 16]))]
        x, cur = "x", list(shape)
        for _ in range(int(self.rng.integers(3, 9))):
            x, cur = self.step(x, cur)
        graph = helper.make_graph(self.nodes, "random", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                                  [helper.make_tensor_value_info(x, TensorProto.FLOAT, cur)], self.inits)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("start", range(0, N_GRAPHS, PER_TEST))
def test_random_graphs_match_onnxruntime(start):
    for seed in range(start, start + PER_TEST):
        model = RandomGraph(seed).build()
        c = compile_model(model, "llvm", "souffle")
        feeds = runner.random_inputs(c.model.inputs, seed)
        outs = runner.run_vm(c.executable, c.model.params, runner.check_feeds(c.model.inputs, feeds))
        _, ref = runner.reference_outputs(model, feeds)
        for cmp in runner.compare(c.model.outputs, outs, ref):
            assert cmp.finite and cmp.rel_l2 < 1e-5, f"seed {seed}: {cmp} ops {[n.op_type for n in model.graph.node]}"
