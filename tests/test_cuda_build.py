"""Every small zoo model's CUDA build compiles with nvcc for sm_80 and sm_90."""

import pytest

from conftest import ZOO, assert_floors_hold, needs_nvcc
from souffle_tvm.pipeline.driver import compile as compile_model


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("name", ZOO)
def test_small_model_cuda_build_compiles_with_nvcc(name, arch):
    compiled = compile_model(name, "cuda", arch=arch, small=True)
    r = compiled.report
    assert r.nvcc["available"], r.nvcc
    assert compiled.cuda_source.count("__global__") >= r.distinct_kernels
    assert r.distinct_kernels == len({k.name for k in r.kernels})
    for k in r.kernels:
        assert k.registers is not None and 0 < k.registers <= 255, k
        assert k.spill_bytes == 0, f"{k.name} spills {k.spill_bytes} bytes"
        assert all(g >= 1 for g in k.grid) and 1 <= k.block[0] * k.block[1] * k.block[2] <= 1024
    assert r.launches >= r.distinct_kernels
    assert_floors_hold(r)
    assert all(k.form == "dlight" and k.measured_form for k in r.kernels)   # TVM's own kernels ran in totals


# Swin's stitched build runs several ptxas feedback rounds (~100 s on 2 cores): `slow`, to keep
# the default suite within its 20 minutes; its emulated numerics stay in tests/test_emulate.py.
STITCHED_BUILDS = [pytest.param(n, marks=pytest.mark.slow) if n == "swin" else n for n in ZOO]


@needs_nvcc
@pytest.mark.parametrize("name", STITCHED_BUILDS)
def test_small_model_stitched_build_compiles_and_fits(name):
    """``--fusion souffle --level v3``: cooperative kernels that ptxas accepts without spills,
    each passing the static check, with grids that can be co-resident."""
    compiled = compile_model(name, "cuda", "souffle", small=True, level="v3")
    r = compiled.report
    coop = [k for k in r.kernels if k.cooperative]
    assert coop and r.nvcc["available"]
    for k in r.kernels:
        assert k.spill_bytes == 0, f"{k.name} spills {k.spill_bytes} bytes"
    for k in coop:
        assert k.grid_syncs and k.grid[0] <= k.max_coresident
    assert_floors_hold(r)


def _gemm(m, n, k, dtype="float16"):
    from tvm import te

    a = te.placeholder((m, k), dtype, name="A")
    w = te.placeholder((k, n), dtype, name="W")
    r = te.reduce_axis((0, k), "k")
    c = te.compute((m, n), lambda i, j: te.sum(a[i, r].astype("float32") * w[r, j].astype("float32"), axis=r), name="C")
    d = te.compute((m, n), lambda i, j: c[i, j].astype(dtype), name="D")
    return te.create_prim_func([a, w, d])


def test_fp16_gemm_gets_a_256_thread_tensor_core_schedule():
    """fp16 GEMMs join stitched kernels on tensor cores (dlight's own rule needs 512 threads)."""
    from souffle_tvm.codegen import schedule
    from souffle_tvm.stitch import kernel_ir, lower
    from souffle_tvm.core.targets import make_target

    cuda = make_target("cuda")
    s = schedule.schedule_group(_gemm(128, 256, 128), cuda, 256)
    assert s.rule == "TensorCoreMatmul"
    assert lower.why_not_stitchable(s.func, cuda, 256) is None
    (stage,) = lower.lower_stage("g", s.func, cuda)
    # the tile is sized to the stitched grid: 16 tiles of 32 x 64 (test_tensorcore.py)
    assert stage.num_threads == 256 and stage.num_blocks == (128 // 32) * (256 // 64)
    assert kernel_ir.calls_to(stage.body, ["tirx.tvm_mma_sync"])
    # dlight alone (no stitching) keeps its 512-thread tensor-core schedule
    assert schedule.schedule_group(_gemm(128, 256, 128), cuda).rule == "Matmul"


@pytest.mark.parametrize("shape,dtype", [((64, 256, 128), "float16"), ((128, 256, 128), "float32")])
def test_small_or_fp32_gemms_keep_the_simt_schedule(shape, dtype):
    from souffle_tvm.codegen import schedule
    from souffle_tvm.core.targets import make_target

    s = schedule.schedule_group(_gemm(*shape, dtype=dtype), make_target("cuda"), 256)
    assert s.rule == "Matmul"


@needs_nvcc
def test_fp16_mlp_stitches_tensor_core_stages_and_compiles():
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array((rng.standard_normal((256, 256)) * 0.05).astype(np.float16), "w1")
    b1 = numpy_helper.from_array(np.zeros(256, np.float16), "b1")
    w2 = numpy_helper.from_array((rng.standard_normal((256, 128)) * 0.05).astype(np.float16), "w2")
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Add", ["h", "b1"], ["hb"]),
             helper.make_node("Relu", ["hb"], ["r"]), helper.make_node("MatMul", ["r", "w2"], ["y"])]
    graph = helper.make_graph(nodes, "mlp16", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [128, 256])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [128, 128])], [w1, b1, w2])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    c = compile_model(model, "cuda", "souffle", level="v3")
    assert c.report.launches == 1, [k.name for k in c.report.kernels]
    assert "mma_sync" in c.cuda_source
    (k,) = c.report.kernels
    # the partition's 256 threads, or the size the model chose for the kernel (and said why)
    (sub,) = [s for s in c.report.subprograms if len(s["indices"]) > 1]
    assert k.block == [sub.get("block", 256), 1, 1] and k.grid_syncs == 1 and k.spill_bytes == 0


def test_column_reduction_gets_a_256_thread_schedule_that_computes_x_times_w():
    """x·W with W laid out [K, N] at batch 1 (the LSTM's recurrent GEMV) used to fall to the
    Fallback in stitched kernels: 4 blocks of one output per thread. Now 16 outputs x 16 slices
    of K per 256-thread block, N / 16 blocks; the emulated schedule computes x·W."""
    import numpy as np
    import tvm
    from tvm import te

    from souffle_tvm.runtime import emulate
    from souffle_tvm.codegen import schedule
    from souffle_tvm.stitch import lower
    from souffle_tvm.core.targets import make_target

    cuda, m, k, n = make_target("cuda"), 1, 256, 1024
    x, w = te.placeholder((m, k), name="x"), te.placeholder((k, n), name="w")
    r = te.reduce_axis((0, k), name="r")
    out = te.compute((m, n), lambda i, j: te.sum(x[i, r] * w[r, j], axis=r), name="gemv")
    scheduled = schedule.schedule_group(te.create_prim_func([x, w, out]), cuda, 256)
    assert scheduled.rule == "ColumnReduction"
    [stage] = lower.lower_stage("gemv", scheduled.func, cuda)
    assert stage.num_threads == 256 and stage.num_blocks == n // 16
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((m, k)).astype("float32"), rng.standard_normal((k, n)).astype("float32")
    ex = tvm.compile(tvm.IRModule({"k": emulate.emulate_primfunc(scheduled.func, cuda, "k")}), target=make_target("llvm"))
    got = tvm.runtime.tensor(np.zeros((m, n), "float32"))
    ex["k"](tvm.runtime.tensor(a), tvm.runtime.tensor(b), got)
    want = a @ b
    assert np.linalg.norm(got.numpy() - want) / np.linalg.norm(want) < 1e-6
