"""Report numbers checked against hand-counted values on tiny graphs."""

import json

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import needs_nvcc
from souffle_tvm import Report
from souffle_tvm.pipeline.driver import compile as compile_model

M, K, N = 4, 64, 128


def tiny(layers=1):
    """x[4,64] -> (MatMul W[64,128] + B -> Relu) -> Softmax, optionally repeated with same shapes."""
    rng = np.random.default_rng(0)
    nodes, inits, x, k = [], [], "x", K
    for i in range(layers):
        inits += [numpy_helper.from_array(rng.standard_normal((k, N)).astype(np.float32), f"W{i}"),
                  numpy_helper.from_array(rng.standard_normal(N).astype(np.float32), f"B{i}")]
        nodes += [helper.make_node("MatMul", [x, f"W{i}"], [f"m{i}"]),
                  helper.make_node("Add", [f"m{i}", f"B{i}"], [f"a{i}"]),
                  helper.make_node("Relu", [f"a{i}"], [f"r{i}"]),
                  helper.make_node("Softmax", [f"r{i}"], [f"y{i}"], axis=-1)]
        x, k = f"y{i}", N
    graph = helper.make_graph(nodes, "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [M, K])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, [M, N])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def by_prefix(report, prefix):
    return next(k for k in report.kernels if k.primfunc.startswith(prefix))


@pytest.mark.parametrize("target", ["llvm", "cuda"])
def test_hand_counted_tiny_graph(target):
    r = compile_model(tiny(), target, nvcc=False).report
    # TVM fuses MatMul+Add+Relu into one kernel; Softmax is a reduction and gets its own.
    assert r.launches == 2 and r.distinct_kernels == 2
    gemm, softmax = by_prefix(r, "fused_matmul_add_relu"), by_prefix(r, "softmax")
    assert gemm.flops == 2 * M * K * N + M * N + M * N            # multiply-add, bias add, relu max
    assert softmax.flops == M * N + 2 * M * N + M * N + M * N     # max, sub+exp, sum, divide
    f32 = 4
    assert gemm.bytes == f32 * (M * K + K * N + N + M * N)       # x, W, B read once; output written once
    assert softmax.bytes == f32 * (M * N + M * N)
    assert r.flops == gemm.flops + softmax.flops and r.bytes == gemm.bytes + softmax.bytes
    if target == "cuda":
        assert gemm.block[0] * gemm.block[1] * gemm.block[2] > 1 and softmax.grid[0] >= 1
        assert r.nvcc["available"] is False and gemm.registers is None


def test_repeated_layers_count_launches_not_distinct_kernels():
    r = compile_model(tiny(layers=3), "cuda", nvcc=False).report
    # Layer 0 reads K=64 features, layers 1-2 read N=128: two GEMM variants, one softmax.
    assert r.launches == 6
    assert r.distinct_kernels == 3
    assert sum(k.launches for k in r.kernels) == 6


@needs_nvcc
def test_ptxas_figures_and_json_round_trip(tmp_path):
    r = compile_model(tiny(), "cuda", arch="sm_80").report
    assert r.nvcc["available"] and r.arch == "sm_80"
    for k in r.kernels:
        assert k.registers and k.registers > 0 and k.spill_bytes == 0 and k.shared_bytes is not None
    assert by_prefix(r, "fused_matmul").shared_bytes > 0       # dlight's GEMM tiles live in shared memory
    path = tmp_path / "r.json"
    r.save(str(path))
    data = json.loads(path.read_text())
    for key in ("model", "target", "fusion", "launches", "distinct_kernels", "compile_seconds", "kernels"):
        assert key in data
    for key in ("name", "grid", "block", "registers", "shared_bytes", "spill_bytes", "launches", "bytes", "flops"):
        assert key in data["kernels"][0]
    assert Report.load(str(path)) == r
    assert "fused_matmul_add_relu_kernel" in r.table()


def test_missing_nvcc_gives_a_report_without_resources(monkeypatch):
    from souffle_tvm.build import ptxas as resources

    monkeypatch.setattr(resources, "nvcc_path", lambda: None)
    r = compile_model(tiny(), "cuda").report
    assert r.nvcc["available"] is False and "nvcc not found" in r.nvcc["note"]
    assert all(k.registers is None and k.spill_bytes is None for k in r.kernels)
    assert r.launches == 2
    assert "nvcc not found" in r.table()


def test_ptxas_output_parser():
    from souffle_tvm.build.ptxas import parse_resource_usage

    text = """ptxas info    : Compiling entry function 'k1' for 'sm_90'
ptxas info    : Function properties for k1
    16 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 49152 bytes smem, 400 bytes cmem[0]
ptxas info    : Compiling entry function 'k2' for 'sm_90'
ptxas info    : Function properties for k2
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 10 registers, 368 bytes cmem[0]
ptxas info    : Compiling entry function 'k3' for 'sm_90'
ptxas info    : Function properties for k3
    8 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 8 bytes cumulative stack size, 25344 bytes smem"""
    res = parse_resource_usage(text)
    # CUDA 13's ptxas puts a kernel's stack size before its shared memory (a 7x7 convolution
    # built for sm_90): the shared memory is still read, or occupancy and co-residency use 0
    assert res["k3"].shared_bytes == 25344 and res["k3"].spill_bytes == 16 and res["k3"].stack_bytes == 8
    assert res["k1"].registers == 255 and res["k1"].shared_bytes == 49152 and res["k1"].spill_bytes == 20
    assert res["k1"].barriers == 1 and res["k1"].stack_bytes == 16
    assert res["k2"].registers == 10 and res["k2"].shared_bytes == 0 and res["k2"].spill_bytes == 0


def test_stitched_totals_add_up_the_kernels():
    """The report's bytes and flops are its kernels' (a stitched kernel counts each stage call:
    the LSTM's recurrent GEMV function runs once per time step)."""
    r = compile_model("lstm", "cuda", "souffle", small=True, level="v3", nvcc=False).report
    v2 = compile_model("lstm", "cuda", "souffle", small=True, level="v2", nvcc=False).report
    # Counted from the LSTM's structure (2 layers, 8 steps, batch 2, features = hidden = 16, so 64
    # gate columns), not from the report's own sum. GEMMs: the input projection of each layer
    # (16 rows x 16 x 64, 2 flops per multiply-add) and the recurrent one per step (2 x 16 x 64),
    # except each layer's first, h0 R^T, folded at compile time (h0 is a constant).
    gemms = 2 * (2 * 16 * 16 * 64) + 2 * 7 * (2 * 2 * 16 * 64)
    # One step's element-wise work on its 2 x 64 gates: x W + h R + b and a sigmoid or tanh (3
    # each), then c = f c + i g and h = o tanh(c) on 2 x 16 (5 each).
    step = 2 * 64 * 3 + 2 * 16 * 5
    # 30 step evaluations, as the v2 kernels show them: the 14 steps the next step's GEMM reads
    # (each layer's last is read only by its output sequence), plus each layer's 8 recomputed
    # where its output sequence composes them (one kernel, two launches: a Concat stored on its
    # own because layer 2's input GEMM reads it, transforms/vertical.py).
    assert r.flops == gemms + 30 * step == 139200
    assert r.flops == v2.flops           # the same groups' arithmetic, one kernel per group at v2
    # bytes: an intermediate counts once in the one stitched kernel, twice (written, read) at v2
    assert len(r.kernels) == 1 and r.bytes == r.kernels[0].bytes < v2.bytes
