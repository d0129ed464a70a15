"""v3 as passes: SoufflePipeline in a user's Sequential, built by the user's own tvm.compile."""

import re
import warnings

import numpy as np
import pytest
import tvm
from tvm import relax

from conftest import needs_nvcc
from souffle_tvm.build import cooperative, ptxas
from souffle_tvm.build.cooperative import COOPERATIVE_TIR_PIPELINE
from souffle_tvm.errors import CooperativeBuildWarning
from souffle_tvm.core.targets import make_target
from souffle_tvm.frontend.importer import import_onnx
from souffle_tvm.pipeline import passes
from souffle_tvm.pipeline.building import cuda_source
from souffle_tvm.pipeline.driver import compile as compile_model
from souffle_tvm.pipeline import results
from souffle_tvm.pipeline.options import Options
from souffle_tvm.runtime import runner
from souffle_tvm.stitch import kernel_ir


@pytest.fixture(scope="module")
def mmoe_v3():
    """Small MMoE through the pass form at v3 for CUDA: (model, module, the warnings it gave)."""
    m = import_onnx("mmoe", small=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mod = passes.SoufflePipeline(make_target("cuda"), m.params, Options(level="v3"))(m.mod)
    return m, mod, [w for w in caught if issubclass(w.category, CooperativeBuildWarning)]


def test_v3_passes_in_a_users_pipeline_build_the_same_cooperative_kernels(tmp_path, mmoe_v3):
    cuda = make_target("cuda")
    m, mod, _ = mmoe_v3
    stitched = passes.info_of(mod)["stitched"]
    # hand-counted: small MMoE is one kernel of 10 stages; the experts' GEMM has 2 blocks, every
    # other stage 1 (block 0 runs them all, so a block barrier orders them: stitch.dependence):
    # one grid sync, before the first stage that reads the experts' output
    assert [(len(k.stages), k.grid_syncs) for k in stitched] == [(10, 1)] and stitched[0].function
    assert len(kernel_ir.calls_to(mod[stitched[0].function].body, (kernel_ir.GRID_SYNC,))) == 1
    ex = tvm.compile(mod, cuda, relax_pipeline=relax.get_default_pipeline(cuda),
                     tir_pipeline=COOPERATIVE_TIR_PIPELINE)
    src = cuda_source(ex)
    # the driver without ptxas feedback (nvcc=False) builds the very same kernels (the pass
    # form's entry check is dropped by the cooperative pipeline, which launches them cooperatively)
    assert src == compile_model("mmoe", "cuda", "souffle", small=True, level="v3", nvcc=False).cuda_source
    assert "grid.sync()" in src or "grid_sync" in src
    lib = tmp_path / "mmoe.so"
    ex.export_library(str(lib))
    assert b"tirx.use_cooperative_launch" in lib.read_bytes()
    assert cooperative.GUARD not in src
    # with TVM's default TIR pipeline the kernels launch without the flag (and trap at entry:
    # test_a_build_with_the_default_tir_pipeline_checks_its_grid_once_at_entry)
    plain = tvm.compile(mod, cuda, relax_pipeline=relax.get_default_pipeline(cuda))
    plain.export_library(str(tmp_path / "plain.so"))
    assert b"tirx.use_cooperative_launch" not in (tmp_path / "plain.so").read_bytes()


@needs_nvcc
def test_a_build_with_the_default_tir_pipeline_checks_its_grid_once_at_entry(mmoe_v3):
    cuda = make_target("cuda")
    _, mod, _ = mmoe_v3
    src = cuda_source(tvm.compile(mod, cuda))      # TVM's default TIR pipeline: no cooperative flag
    # the check: a valid cooperative grid, else a device-side assert naming the pipeline, then a trap
    helper = src[src.index(f"void {cooperative.GUARD}()"):]
    helper = helper[:helper.index("\n}\n")]
    assert "cooperative_groups::this_grid().is_valid()" in helper and "__trap();" in helper
    assert "COOPERATIVE_TIR_PIPELINE" in helper
    kernels = re.findall(r'extern "C" __global__[^;{]*\{(.*?)\n\}', src, re.S)
    stitched = [k for k in kernels if "tvm_builtin_cuda_grid_sync();" in k]
    assert stitched and len(stitched) == len(passes.info_of(mod)["stitched"])
    for body in stitched:
        # once per kernel, before anything else runs (its first grid sync included), never per sync
        assert body.count(f"{cooperative.GUARD}();") == 1
        statements = [ln.strip() for ln in body.splitlines() if ln.strip() and not ln.strip().startswith(
            ("__shared__", "alignas", "float", "int", "half", "uint"))]
        assert statements[0] == f"{cooperative.GUARD}();"
        assert body.index(f"{cooperative.GUARD}();") < body.index("tvm_builtin_cuda_grid_sync();")
    # nvcc compiles it (assert, is_valid and __trap are device code it accepts)
    assert ptxas.measure(src, "sm_90")


def test_the_pass_form_warns_once_that_the_build_needs_the_cooperative_pipeline(mmoe_v3):
    m, _, caught = mmoe_v3
    assert len(caught) == 1
    note = str(caught[0].message)
    assert "COOPERATIVE_TIR_PIPELINE" in note and "souffle_tvm.transform" in note
    cuda, llvm = make_target("cuda"), make_target("llvm")
    with warnings.catch_warnings():
        warnings.simplefilter("error", CooperativeBuildWarning)
        # no stitched kernels, no warning: v2 on CUDA, v3 on the CPU twin ...
        passes.SoufflePipeline(cuda, m.params, Options(level="v2"))(m.mod)
        passes.SoufflePipeline(llvm, m.params, Options(level="v3"))(m.mod)
        # ... and the driver, which always builds with the cooperative pipeline, neither warns nor guards
        driven = results.run(m.mod, cuda, m.params, Options(level="v3"))
    assert driven.stitched and not any(cooperative.has_guard(f) for f in driven.mod.functions.values()
                                       if isinstance(f, tvm.tirx.PrimFunc))


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
