"""The default level on CUDA builds what Souffle builds, whatever TVM's own build does (issue 33).

``--level auto`` also builds TVM's own kernels to compare predicted times. TVM 0.27's dlight
schedules a grouped convolution in a way its own lowering rejects (LowerCrossThreadReduction:
"Cross-thread reduction requires all the reduction-related loops to be the deepest"), which
used to fail the whole compile although Souffle's build was fine: found by ONNX's conformance
model tests (pytorch-converted ``test_Conv2d_groups``) built for CUDA at the default level.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper

from conftest import needs_nvcc
from souffle_tvm.pipeline.driver import compile as compile_model


def grouped_conv():
    """Conv2d with 2 groups (4 -> 6 channels, 3x2 kernel) plus bias, as torch exports it."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((6, 2, 3, 2)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal(6).astype(np.float32), "b")
    node = h.make_node("Conv", ["x", "w", "b"], ["y"], group=2, kernel_shape=[3, 2])
    graph = h.make_graph([node], "grouped", [h.make_tensor_value_info("x", T.FLOAT, [2, 4, 6, 5])],
                         [h.make_tensor_value_info("y", T.FLOAT, [2, 6, 4, 4])], [w, b])
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])


@needs_nvcc
def test_a_grouped_convolution_builds_at_the_default_level():
    c = compile_model(grouped_conv(), "cuda", "souffle")
    r = c.report
    assert r.nvcc["available"] and r.kernels and all(k.registers for k in r.kernels)
    assert not r.fallback
    # the comparison failed and says so; Souffle's build is what was returned
    assert "tvm_build_failed" in r.latency and "Souffle's build is kept" in r.table()
