"""Lowering to one TEProgram, and the analysis of its stages and edges."""

import numpy as np
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import te

from conftest import ZOO
from souffle_tvm.te import analysis
from souffle_tvm.runtime import runner
from souffle_tvm.te import program as te_program
from souffle_tvm.frontend.importer import import_onnx


def run_program(prog, imported, feeds):
    """Build the whole TEProgram as ONE PrimFunc on llvm and run it (the algebra, unscheduled)."""
    consts = list(prog.constants)
    func = te.create_prim_func(list(prog.inputs) + list(prog.weights) + consts + list(prog.outputs))
    lib = tvm.compile(tvm.IRModule({"main": func}), target="llvm")
    args = [tvm.runtime.tensor(feeds[t.op.name]) for t in prog.inputs]
    args += [tvm.runtime.tensor(v) for v in prog.weight_arrays()]
    args += [tvm.runtime.tensor(prog.constants[c]) for c in consts]
    outs = [tvm.runtime.tensor(np.zeros([int(d) for d in t.shape], str(t.dtype))) for t in prog.outputs]
    lib["main"](*args, *outs)
    return [o.numpy() for o in outs]


# Swin's unscheduled whole program takes ~30 s on llvm: `slow`; its lowering is checked in the
# default suite through test_transforms' swin cases (vertical, all), which start from it.
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "swin" else n for n in ZOO])
def test_every_small_model_lowers_whole_and_matches(name):
    m = import_onnx(name, small=True)
    prog = te_program.lower(m.mod, weight_values=m.params)
    assert not prog.opaque, [o.reason for o in prog.opaque]
    assert len(prog.stages()) > 10
    feeds = runner.random_inputs(m.inputs, 0)
    got = run_program(prog, m, feeds)
    _, ref = runner.reference_outputs(m.onnx_model, feeds)
    for c in runner.compare(m.outputs, got, ref):
        assert c.finite and c.rel_l2 < 1e-5, (name, c)


def tiny_attention():
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((16, 16)).astype(np.float32), "W")
    b = numpy_helper.from_array(rng.standard_normal(16).astype(np.float32), "B")
    shape = numpy_helper.from_array(np.array([1, 8, 2, 8], np.int64), "S")
    idx = helper.make_tensor_value_info("ids", TensorProto.INT64, [3])
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["m"]),
        helper.make_node("Add", ["m", "B"], ["a"]),
        helper.make_node("Reshape", ["a", "S"], ["r"]),
        helper.make_node("Transpose", ["r"], ["t"], perm=[0, 2, 1, 3]),
        helper.make_node("Softmax", ["t"], ["s"], axis=-1),
        helper.make_node("Gather", ["x", "ids"], ["g"], axis=1),
    ]
    graph = helper.make_graph(nodes, "att", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 16]), idx],
                              [helper.make_tensor_value_info("s", TensorProto.FLOAT, [1, 2, 8, 8]),
                               helper.make_tensor_value_info("g", TensorProto.FLOAT, [1, 3, 16])], [w, b, shape])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_analysis_kinds_index_maps_and_counts():
    m = import_onnx(tiny_attention())
    a = analysis.analyze(te_program.lower(m.mod, weight_values=m.params))
    by_op = {}
    for s in a.stages:
        by_op.setdefault(s.op, []).append(s)
    mm = by_op["relax.matmul"][0]
    assert (mm.kind, mm.detail, mm.compute_intensive) == ("reduction", "contraction", True)
    assert mm.flops == 2 * 8 * 16 * 16
    assert {e.pattern for e in mm.edges} == {"reduce-read"}
    assert max(e.reuse for e in mm.edges) == 16            # each x element feeds 16 outputs
    add = by_op["relax.add"][0]
    assert (add.kind, add.detail) == ("one-to-one", "elementwise")
    assert sorted(e.pattern for e in add.edges) == ["broadcast", "identity"]
    assert by_op["relax.reshape"][0].detail == "reshape"
    tr = by_op["relax.permute_dims"][0]
    assert tr.detail == "transpose" and tr.edges[0].pattern == "permute"
    assert "i2, i1" in tr.edges[0].index_map or "ax2, ax1" in tr.edges[0].index_map
    soft = by_op["relax.nn.softmax"]
    assert sorted(s.kind for s in soft) == ["one-to-one", "one-to-one", "reduction", "reduction"]
    assert by_op["relax.take"][0].kind == "gather"
    assert a.counts()["reduction"] == 3 and a.counts()["gather"] == 1


def test_extern_op_becomes_opaque_not_a_crash():
    node = helper.make_node("CumSum", ["x", "ax"], ["y"])
    graph = helper.make_graph([helper.make_node("Relu", ["x0"], ["x"]), node], "g",
                              [helper.make_tensor_value_info("x0", TensorProto.FLOAT, [4, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])],
                              [numpy_helper.from_array(np.array(1, np.int64), "ax")])
    m = import_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    prog = te_program.lower(m.mod)
    assert len(prog.opaque) == 1 and "cumsum" in prog.opaque[0].reason
    a = analysis.analyze(prog)
    assert a.counts()["opaque"] == 1


def test_multi_output_ops_lower_to_stages_not_opaque_calls():
    """batch_norm and split legalize to an FFI array of tensors: each field is an ordinary stage
    (the fuzzer found them opaque, and their re-emission failing)."""
    c = np.ones(6, np.float32)
    inits = [numpy_helper.from_array(c * v, n) for v, n in ((1, "s"), (0, "b"), (0, "m"), (1, "v"))]
    inits.append(numpy_helper.from_array(np.array([8, 8], np.int64), "parts"))
    nodes = [helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["bn"]),
             helper.make_node("Split", ["bn", "parts"], ["p", "q"], axis=-1),
             helper.make_node("Add", ["p", "q"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 6, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 6, 8])], inits)
    m = import_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    prog = te_program.lower(m.mod, weight_values=m.params)
    assert not prog.opaque, [o.reason for o in prog.opaque]
