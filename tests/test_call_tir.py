"""``call_tir`` calls already in the imported module (issue 18, class 3).

TVM's ONNX importer writes Clip (its NaN-guarded bounds) and Tile as ``call_tir`` of PrimFuncs it
made with ``bb.call_te``. A PrimFunc that is one spatial loop nest becomes a TE stage
(``te.from_primfunc``) and fuses like any other; any other PrimFunc (a reduction, several
blocks) stays an opaque stage that runs: its PrimFunc is carried into the emitted module.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from onnx import TensorProto, helper
from tvm import relax, topi

from souffle_tvm.build import executable
from souffle_tvm.core.targets import make_target
from souffle_tvm.frontend.importer import import_onnx
from souffle_tvm.pipeline import results
from souffle_tvm.pipeline.options import Options
from souffle_tvm.runtime import runner
from souffle_tvm.te import program as te_program


def _clip_model():
    nodes = [helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("Constant", [], ["lo"], value=helper.make_tensor("lo", TensorProto.FLOAT, [], [-0.5])),
             helper.make_node("Constant", [], ["hi"], value=helper.make_tensor("hi", TensorProto.FLOAT, [], [0.75])),
             helper.make_node("Clip", ["r", "lo", "hi"], ["c"]), helper.make_node("Tile", ["c", "reps"], ["y"])]
    graph = helper.make_graph(nodes, "clip_tile", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 24])],
                              [helper.make_tensor("reps", TensorProto.INT64, [2], [2, 3])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_spatial_call_tir_becomes_te_stages():
    m = import_onnx(_clip_model())
    calls = [b.value for blk in m.mod["main"].body.blocks for b in blk.bindings
             if getattr(getattr(b.value, "op", None), "name", "") == "relax.call_tir"]
    assert len(calls) >= 2, "the importer wrote Clip's bounds and Tile as call_tir"
    prog = te_program.lower(m.mod, weight_values=m.params)
    assert prog.opaque == []
    assert any(name.startswith("relax.call_tir") for name in prog.op_of.values())


@pytest.mark.parametrize("fusion", ["tvm", "souffle"])
def test_spatial_call_tir_matches_onnxruntime(fusion):
    from souffle_tvm.pipeline.driver import compile as compile_model

    compiled = compile_model(_clip_model(), "llvm", fusion)
    assert fusion == "tvm" or compiled.report.fallback is None, compiled.report.fallback
    feeds = runner.random_inputs(compiled.model.inputs, 2)
    outs = runner.run_vm(compiled.executable, compiled.model.params, runner.check_feeds(compiled.model.inputs, feeds))
    _, ref = runner.reference_outputs(compiled.model.onnx_model, feeds)
    (c,) = runner.compare(compiled.model.outputs, outs, ref)
    assert c.finite and c.rel_l2 < 1e-5, c.rel_l2


def _with_a_reduction_call_tir() -> tvm.IRModule:
    """main(x) = relu(sum(relu(x), axis=1)) with the sum as a call_tir (a reduction block)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([4, 16], "float32"))
    with bb.function("main", [x], attrs={"num_input": 1}):
        with bb.dataflow():
            r = bb.emit(relax.op.nn.relu(x))
            s = bb.emit_te(topi.sum, r, axis=1)
            out = bb.emit_output(relax.op.nn.relu(s))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("level", ["v2", "v3"])
def test_other_call_tir_stays_opaque_and_runs(level):
    mod = _with_a_reduction_call_tir()
    prog = te_program.lower(mod)
    (o,) = prog.opaque
    assert "call_tir" in o.reason and o.callees
    souffle = results.run(mod, make_target("llvm"), [], Options(level=level))
    ex = executable.build(souffle.mod, make_target("llvm")).executable
    x = np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32)
    (y,) = runner.run_vm(ex, [], [x])
    np.testing.assert_allclose(y, np.maximum(np.maximum(x, 0).sum(1), 0), rtol=1e-5, atol=1e-6)


def test_other_call_tir_stays_opaque_at_the_default_level_on_cuda():
    # the default's time partitioner prices on-chip credits from every group's call; an opaque
    # group has none of ours (a KeyError ended the compile before 2026-12-05)
    mod = _with_a_reduction_call_tir()
    default = Options(level="auto").resolved()
    souffle = results.run(mod, make_target("cuda"), [], default)
    assert souffle.options.partitioner == "time" and len(souffle.program.opaque) == 1
    ex = executable.build(results.run(mod, make_target("llvm"), [], default).mod, make_target("llvm")).executable
    x = np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32)
    (y,) = runner.run_vm(ex, [], [x])
    np.testing.assert_allclose(y, np.maximum(np.maximum(x, 0).sum(1), 0), rtol=1e-5, atol=1e-6)
