"""Every PrimFunc handed to TVM has a root block (issue 33, item 1b).

A YOLO-style detector's weightless chain (Slice, MaxPool, Resize, Concat) stitched into one
kernel took a single input, so Relax's RewriteDataflowReshape asked whether the stitched
kernel is a reshape, and ``has_reshape_pattern`` aborted on its launch-form body ("Check
failed: func->body->IsInstance<SBlockRealizeNode>()"). Group PrimFuncs are checked where
``codegen.emit`` emits them; stitched kernels get their root block where the build hands the
module to TVM (``build.executable.build``).
"""

from __future__ import annotations

import pytest
import tvm
from onnx import TensorProto as T
from onnx import helper as h
from tvm import relax, tirx

from conftest import needs_nvcc
from souffle_tvm.build.launch_bounds import with_launch_bounds
from souffle_tvm.core import root_block
from souffle_tvm.core.ir_names import TVM_MIN_BLOCKS
from souffle_tvm.core.targets import make_target
from souffle_tvm.errors import SouffleError
from souffle_tvm.frontend.importer import import_onnx
from souffle_tvm.pipeline import results
from souffle_tvm.pipeline.driver import compile as compile_model
from souffle_tvm.pipeline.options import Feedback, Options


def yolo_route(size: int = 32, channels: int = 8):
    """A YOLO route: half the channels (Slice), two 2x2 MaxPools, nearest Resize back up (x4),
    concatenated with the sliced map. No weights: one input reaches the stitched kernel."""
    c = channels // 2
    init = [h.make_tensor("starts", T.INT64, [1], [c]), h.make_tensor("ends", T.INT64, [1], [channels]),
            h.make_tensor("axes", T.INT64, [1], [1]), h.make_tensor("scales", T.FLOAT, [4], [1, 1, 4, 4])]
    nodes = [h.make_node("Slice", ["x", "starts", "ends", "axes"], ["half"]),
             h.make_node("MaxPool", ["half"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
             h.make_node("MaxPool", ["p1"], ["p2"], kernel_shape=[2, 2], strides=[2, 2]),
             h.make_node("Resize", ["p2", "", "scales"], ["up"], mode="nearest"),
             h.make_node("Concat", ["up", "half"], ["y"], axis=1)]
    graph = h.make_graph(nodes, "yolo_route", [h.make_tensor_value_info("x", T.FLOAT, [1, channels, size, size])],
                         [h.make_tensor_value_info("y", T.FLOAT, [1, channels, size, size])], init)
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])


def test_the_stitched_route_is_one_input_kernel_without_root_block():
    """What the build has to fix: the v3 pipeline stitches the route into one kernel with one
    input, in launch form (the stitcher's and the emulator's form), which TVM's analysis rejects."""
    m = import_onnx(yolo_route())
    target = make_target("cuda")
    sm = results.run(m.mod, target, m.params, Options(level="v3").check(target), Feedback())
    calls = [b.value for blk in sm.mod["main"].body.blocks for b in blk.bindings
             if isinstance(b.value, relax.Call) and getattr(b.value.op, "name", "") == "relax.call_tir"]
    stitched = [c for c in calls if "stitched" in c.args[0].name_hint]
    assert len(stitched) == 1 and len(stitched[0].args[1].fields) == 1
    name = stitched[0].args[0].name_hint
    assert root_block.without_root_block(sm.mod) == [name]
    fixed = root_block.ensure_root_blocks(sm.mod)
    assert root_block.without_root_block(fixed) == []
    assert relax.analysis.has_reshape_pattern(fixed[name]) is False
    with pytest.raises(SouffleError, match=name):
        root_block.require_root_blocks(sm.mod, "test")


@needs_nvcc
@pytest.mark.parametrize("level", ["v3", "auto"])
def test_yolo_route_builds_for_cuda(level):
    """Before the fix: InternalError from has_reshape_pattern at v3 (auto stitches nothing here:
    it checks the default level keeps building the same route)."""
    c = compile_model(yolo_route(), "cuda", "souffle", level=level)
    r = c.report
    assert r.nvcc["available"] and r.kernels and not r.fallback
    assert all(k.registers for k in r.kernels)


def test_launch_bounds_see_through_the_root_block():
    """The register-cap pass, first in the TIR pipeline, now meets stitched kernels under a root block."""
    tx = tirx.Var("threadIdx.x", "int32")
    iv = tirx.IterVar(tvm.ir.Range(0, 32), tx, 1, "threadIdx.x")
    bx = tirx.IterVar(tvm.ir.Range(0, 4), tirx.Var("blockIdx.x", "int32"), 1, "blockIdx.x")
    body = tirx.AttrStmt(bx, "thread_extent", 4, tirx.AttrStmt(iv, "thread_extent", 32, tirx.Evaluate(0)))
    func = root_block.with_root_block(tirx.PrimFunc([], body))
    capped = with_launch_bounds(func, 2)
    assert root_block.has_root_block(capped)
    assert root_block.under_root(capped).body.attr_key == TVM_MIN_BLOCKS   # the cap, under blockIdx.x


@needs_nvcc
def test_the_pass_form_hands_tvm_compile_root_blocks():
    """A user's own tvm.compile of the pass form's output (one-input stitched kernel): the pass
    form's last step puts the stitched kernels under root blocks, so Relax's reshape analysis
    reads them, and the cooperative pipeline still finds and drops their entry check."""
    import warnings

    from souffle_tvm.build import cooperative
    from souffle_tvm.pipeline import building, passes

    m = import_onnx(yolo_route())
    cuda = make_target("cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mod = passes.SoufflePipeline(cuda, m.params, Options(level="v3"))(m.mod)
    assert passes.info_of(mod)["stitched"] and root_block.without_root_block(mod) == []
    ex = tvm.compile(mod, cuda, relax_pipeline=relax.get_default_pipeline(cuda),
                     tir_pipeline=cooperative.COOPERATIVE_TIR_PIPELINE)
    src = building.cuda_source(ex)
    assert "grid_sync" in src and cooperative.GUARD not in src
