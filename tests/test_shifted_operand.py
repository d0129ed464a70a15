"""A cyclic shift (Swin's shifted windows: ``torch.roll`` exported as two Slices and a Concat per
axis) in front of a GEMM. Composed into the GEMM's operand it was four loads of one tensor
under selects, which no GEMM rule tiles: the GEMM fell to Fallback (one output a thread, 155 us
of each full-size Swin shifted block's QKV projection). The concatenation is now stored once
by a kernel of its own and the GEMM reads one tensor."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import needs_nvcc, run_and_compare
from souffle_tvm.frontend.importer import import_onnx
from souffle_tvm.pipeline.driver import compile as compile_model
from souffle_tvm.te import analysis, program as te_program
from souffle_tvm.transforms import vertical

H, W, C, N, SHIFT = 8, 8, 32, 64, 3


def _rolled_gemm(path) -> str:
    """LayerNorm over C, a roll by SHIFT along H and W (Slice, Slice, Concat per axis, as torch
    exports it), then a GEMM of the H*W rows."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(a, n) for n, a in (
        ("g", (1 + 0.1 * rng.standard_normal(C)).astype("float32")), ("b", (0.1 * rng.standard_normal(C)).astype("float32")),
        ("w", (rng.standard_normal((C, N)) / np.sqrt(C)).astype("float32")),
        ("rows", np.array([H * W, C], "int64")))]
    nodes = [helper.make_node("LayerNormalization", ["x", "g", "b"], ["ln"], axis=-1, epsilon=1e-5)]
    src = "ln"
    for axis, extent in ((0, H), (1, W)):
        for part, (lo, hi) in (("a", (extent - SHIFT, extent)), ("b", (0, extent - SHIFT))):
            consts = [numpy_helper.from_array(np.array([v], "int64"), f"{part}{axis}_{n}")
                      for n, v in (("s", lo), ("e", hi), ("x", axis))]
            inits += consts
            nodes.append(helper.make_node("Slice", [src] + [c.name for c in consts], [f"{part}{axis}"]))
        nodes.append(helper.make_node("Concat", [f"a{axis}", f"b{axis}"], [f"r{axis}"], axis=axis))
        src = f"r{axis}"
    nodes += [helper.make_node("Reshape", [src, "rows"], ["flat"]), helper.make_node("MatMul", ["flat", "w"], ["y"])]
    graph = helper.make_graph(nodes, "rolled_gemm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [H, W, C])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [H * W, N])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    out = str(path / "rolled_gemm.onnx")
    with open(out, "wb") as f:
        f.write(model.SerializeToString())
    return out


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return _rolled_gemm(tmp_path_factory.mktemp("rolled"))


def test_the_shift_the_gemm_reads_is_kept_and_the_one_before_it_composed(model):
    prog = te_program.lower(import_onnx(model).mod)
    concats = [t for t in prog.stages() if analysis.selects_among_loads(t.op)]
    assert len(concats) == 2 and all(analysis.classify(t.op)[1] == "concat" for t in concats)
    v = vertical(prog)
    kept = {n: r for n, r in v.kept.items() if "selects among" in r}
    assert len(kept) == 1 and "matmul" in next(iter(kept.values())), v.kept
    # the kept concatenation composes the other one: four pieces of the normalised rows
    (stored,) = [t for t in v.program.stages() if analysis.selects_among_loads(t.op)]
    assert len(stored.op.input_tensors) >= 1 and not any(
        analysis.selects_among_loads(x.op) for x in stored.op.input_tensors)


@pytest.mark.parametrize("level", ["v2", "v3"])
def test_a_rolled_gemm_matches_onnxruntime_on_llvm(model, level):
    compiled = compile_model(model, "llvm", "souffle", level=level)
    (c,) = run_and_compare(compiled)
    assert c.finite and c.rel_l2 < 1e-5, c


@needs_nvcc
def test_a_rolled_gemm_is_tiled_by_a_gemm_rule_on_cuda(model):
    r = compile_model(model, "cuda", "souffle", arch="sm_90", level="v3").report
    assert not r.fallback
    stages = [(form, st["flops"]) for k in r.kernels
              for form, st in zip(k.form.split(" + "), k.stage_plan or [{"flops": k.flops}])]
    form, flops = max(stages, key=lambda s: s[1])
    assert flops >= 2 * H * W * C * N and form.split("@")[0] in ("StitchedMatmul", "TensorCoreMatmul"), stages
    shifted = [g for g in r.groups if "selects among shifted pieces" in g["reason"]]
    assert len(shifted) == 1 and len(shifted[0]["members"]) == 1, r.groups
