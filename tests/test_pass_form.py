"""v3 as passes: SoufflePipeline in a user's Sequential, built by the user's own tvm.compile."""

import numpy as np
import tvm
from tvm import relax

from souffle_tvm.build.cooperative import COOPERATIVE_TIR_PIPELINE
from souffle_tvm.core.targets import make_target
from souffle_tvm.frontend.importer import import_onnx
from souffle_tvm.pipeline import passes
from souffle_tvm.pipeline.building import cuda_source
from souffle_tvm.pipeline.driver import compile as compile_model
from souffle_tvm.pipeline.options import Options
from souffle_tvm.runtime import runner
from souffle_tvm.stitch import kernel_ir


def test_v3_passes_in_a_users_pipeline_build_the_same_cooperative_kernels(tmp_path):
    cuda = make_target("cuda")
    m = import_onnx("mmoe", small=True)
    mod = tvm.transform.Sequential([passes.SoufflePipeline(cuda, m.params, Options(level="v3"))])(m.mod)
    stitched = passes.info_of(mod)["stitched"]
    # hand-counted: small MMoE is one kernel of 10 stages in 8 dependent steps (the experts' and
    # the gates' GEMMs side by side, and one task's tower GEMM beside the other's softmax):
    # 7 grid syncs
    assert [(len(k.stages), k.grid_syncs) for k in stitched] == [(10, 7)] and stitched[0].function
    assert len(kernel_ir.calls_to(mod[stitched[0].function].body, (kernel_ir.GRID_SYNC,))) == 7
    ex = tvm.compile(mod, cuda, relax_pipeline=relax.get_default_pipeline(cuda),
                     tir_pipeline=COOPERATIVE_TIR_PIPELINE)
    src = cuda_source(ex)
    # the driver without ptxas feedback (nvcc=False) builds the very same kernels
    assert src == compile_model("mmoe", "cuda", "souffle", small=True, level="v3", nvcc=False).cuda_source
    assert "grid.sync()" in src or "grid_sync" in src
    lib = tmp_path / "mmoe.so"
    ex.export_library(str(lib))
    assert b"tirx.use_cooperative_launch" in lib.read_bytes()
    # with TVM's default TIR pipeline the kernels would launch without the flag (and deadlock)
    plain = tvm.compile(mod, cuda, relax_pipeline=relax.get_default_pipeline(cuda))
    plain.export_library(str(tmp_path / "plain.so"))
    assert b"tirx.use_cooperative_launch" not in (tmp_path / "plain.so").read_bytes()


def test_v3_passes_on_the_cpu_twin_match_onnxruntime():
    llvm = make_target("llvm")
    m = import_onnx("bert", small=True)
    mod = tvm.transform.Sequential([relax.transform.FoldConstant(),
                                    passes.SoufflePipeline(llvm, m.params, Options(level="v3"))])(m.mod)
    assert passes.info_of(mod)["two_phase"] is not None and "stitched" not in passes.info_of(mod)
    ex = tvm.compile(mod, llvm)
    feeds = runner.random_inputs(m.inputs, 3)
    outs = runner.run_vm(ex, [p.numpy() for p in passes.params_of(mod)], runner.check_feeds(m.inputs, feeds))
    _, ref = runner.reference_outputs(m.onnx_model, feeds)
    for c in runner.compare(m.outputs, outs, ref):
        assert c.rel_l2 < 1e-5
    assert all(np.isfinite(o).all() for o in outs)
