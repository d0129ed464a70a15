"""Bad input through the CLI, as a user meets it: exit 2 and one line that says what to do,
never a traceback, and nothing of TVM's after our message (issue 19)."""

import os
import shutil
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from souffle_tvm import zoo
from souffle_tvm.errors import SouffleError
from souffle_tvm.frontend.importer import TensorInfo
from souffle_tvm.runtime import runner

EXE = shutil.which("souffle-tvm", path=os.path.dirname(sys.executable)) or "souffle-tvm"


def _cli(*args):
    proc = subprocess.run([EXE, *args], capture_output=True, text=True, timeout=600)
    return proc.returncode, proc.stdout, proc.stderr


def _refused(*args, match: str):
    """Exit 2 and exactly one stderr line, ours: nothing of TVM's, onnxruntime's or Python's
    before or after it."""
    code, _, err = _cli(*args)
    lines = err.strip().splitlines()
    assert code == 2, err[-1500:]
    assert len(lines) == 1, err[-1500:]
    assert lines[0].startswith("souffle-tvm: error:") and match in lines[0], err[-1500:]
    return lines[0]


def _save(path, nodes, inputs, outputs, inits=(), opset: int = 13) -> str:
    """A tiny hand-made model (not checked: some are meant to be invalid)."""
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    onnx.save(model, str(path))
    return str(path)


def _vec(name: str, elem=TensorProto.FLOAT, shape=(4,)):
    return helper.make_tensor_value_info(name, elem, list(shape))


@pytest.fixture(scope="module")
def mmoe(tmp_path_factory):
    path = tmp_path_factory.mktemp("bad") / "mmoe.onnx"
    onnx.save(zoo.build("mmoe", small=True), str(path))
    return str(path)


@pytest.fixture(scope="module")
def dyn(tmp_path_factory, mmoe):
    """The small mmoe with a dynamic batch dimension ('batch' x 32)."""
    model = onnx.load(mmoe)
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "batch"
    path = str(tmp_path_factory.mktemp("dyn") / "dyn.onnx")
    onnx.save(model, path)
    return path


def test_a_huge_dynamic_shape_is_refused_with_the_bytes_it_needs(dyn):
    last = _refused("run", dyn, "--input-shapes", "features:100000000000x32", match="TiB")
    assert "available" in last and "--input-shapes" in last


def test_the_memory_check_counts_what_it_would_allocate():
    info = [TensorInfo("x", (1024, 1024), "float32")]     # 4 MiB, drawn in float64 first: 12 MiB
    runner.check_memory(info, available=13 << 20)
    with pytest.raises(SouffleError, match="12.0 MiB"):
        runner.check_memory(info, available=11 << 20)


def test_a_corrupt_inputs_file_is_named(tmp_path, mmoe):
    bad = tmp_path / "in.npz"
    bad.write_bytes(b"not an archive")
    _refused("run", mmoe, "--inputs", str(bad), match="--inputs")
    np.savez(tmp_path / "ok.npz", features=np.zeros((1, 32), "float32"))
    (tmp_path / "cut.npz").write_bytes((tmp_path / "ok.npz").read_bytes()[:60])
    _refused("run", mmoe, "--inputs", str(tmp_path / "cut.npz"), match="cut short")


def test_output_paths_that_cannot_be_written_are_refused_before_compiling(tmp_path, mmoe):
    _refused("compile", mmoe, "--target", "llvm", "-o", str(tmp_path / "no" / "x.so"), match="does not exist")
    _refused("compile", mmoe, "--target", "llvm", "--report", str(tmp_path), match="is a folder")
    _refused("run", mmoe, "--outputs", str(tmp_path / "no" / "o.npz"), match="--outputs")


def test_an_output_declared_without_a_shape_is_given_one(tmp_path):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)      # as some exporters write
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    path = str(tmp_path / "untyped.onnx")
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), path)
    code, out, err = _cli("run", path, "--check")
    assert code == 0 and "ok" in out, err[-1500:]


def test_a_failed_import_ends_with_our_message_not_tvms_warning(tmp_path):
    x = helper.make_tensor_value_info("x", TensorProto.INT32, [4])
    y = helper.make_tensor_value_info("y", TensorProto.INT32, [4])
    shift = helper.make_tensor("s", TensorProto.INT32, [4], [1, 1, 1, 1])
    node = helper.make_node("BitShift", ["x", "s"], ["y"], direction="LEFT")
    model = helper.make_model(helper.make_graph([node], "g", [x], [y], [shift]),
                              opset_imports=[helper.make_opsetid("", 13)])
    model.graph.node[0].attribute[0].s = b"UP"       # TVM's converter raises half-way through
    path = str(tmp_path / "shift.onnx")
    onnx.save(model, path)
    _refused("compile", path, "--target", "llvm", match="TVM's ONNX importer failed")


def test_input_shapes_for_an_input_the_model_lacks_are_refused_naming_its_inputs(mmoe):
    last = _refused("run", mmoe, "--input-shapes", "nosuch:3x3", match="--input-shapes")
    assert "'nosuch'" in last and "features" in last


def test_inputs_holding_arrays_the_model_does_not_take_are_refused_naming_them(tmp_path, mmoe):
    path = str(tmp_path / "in.npz")
    np.savez(path, features=np.zeros((1, 32), "float32"), extra=np.zeros(3), more=np.zeros(2))
    last = _refused("run", mmoe, "--inputs", path, match="--inputs")
    assert "'extra'" in last and "'more'" in last and "features" in last


def test_inputs_of_another_dtype_are_refused_naming_both_dtypes(tmp_path, mmoe):
    path = str(tmp_path / "in.npz")
    np.savez(path, features=np.zeros((1, 32), "int64"))       # onnxruntime refuses it too
    last = _refused("run", mmoe, "--inputs", path, match="'features'")
    assert "int64" in last and "float32" in last and "--inputs" in last


@pytest.mark.parametrize("item", ["features:axb", "features:1x0", "features:1x-32"])
def test_input_shapes_with_dims_that_are_not_sizes_are_refused_with_the_form(mmoe, item):
    last = _refused("analyze", mmoe, "--input-shapes", item, match="--input-shapes")
    assert "NAME:DxD" in last and repr(item) in last


def test_a_folder_given_as_the_model_is_named_a_folder(tmp_path):
    (tmp_path / "models").mkdir()
    last = _refused("run", str(tmp_path / "models"), match="is a folder")
    assert ".onnx file" in last and "Errno" not in last


def test_a_dynamic_input_suggests_the_cli_option_and_the_python_api_keeps_its_form(dyn):
    last = _refused("run", dyn, match="--input-shapes features:")
    assert "shapes={" not in last and "'batch'" in last
    from souffle_tvm.errors import DynamicShapeError
    from souffle_tvm.frontend.importer import load_model, graph_inputs

    with pytest.raises(DynamicShapeError, match=r"shapes=\{'features'"):
        graph_inputs(load_model(dyn)[1])


def test_a_cyclic_graph_is_refused_as_a_cycle(tmp_path):
    nodes = [helper.make_node("Relu", ["b"], ["a"], name="r"), helper.make_node("Neg", ["a"], ["b"], name="n"),
             helper.make_node("Add", ["x", "a"], ["y"], name="add")]
    path = _save(tmp_path / "m.onnx", nodes, [_vec("x")], [_vec("y")])
    last = _refused("compile", path, "--target", "llvm", match="cycle")
    assert "'r'" in last and "'n'" in last


def test_two_nodes_writing_one_tensor_are_refused_naming_both(tmp_path):
    nodes = [helper.make_node("Relu", ["x"], ["y"], name="first"), helper.make_node("Neg", ["x"], ["y"], name="second")]
    path = _save(tmp_path / "twice.onnx", nodes, [_vec("x")], [_vec("y")])
    last = _refused("compile", path, "--target", "llvm", match="'y'")
    assert "'first'" in last and "'second'" in last


def test_an_opset_newer_than_the_importer_knows_is_refused(tmp_path):
    path = _save(tmp_path / "future.onnx", [helper.make_node("Relu", ["x"], ["y"])], [_vec("x")], [_vec("y")],
                 opset=99)
    last = _refused("run", path, "--check", match="opset 99")
    assert str(onnx.defs.onnx_opset_version()) in last


def test_weights_in_a_missing_external_data_file_are_named(tmp_path):
    w = helper.make_tensor("w", TensorProto.FLOAT, [4], np.arange(4, dtype="float32").tobytes(), raw=True)
    graph = helper.make_graph([helper.make_node("Add", ["x", "w"], ["y"])], "g", [_vec("x")], [_vec("y")], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    path = str(tmp_path / "ext.onnx")
    onnx.save(model, path, save_as_external_data=True, location="ext.onnx.data", size_threshold=0)
    os.remove(tmp_path / "ext.onnx.data")
    last = _refused("run", path, match="ext.onnx.data")
    assert "is missing from" in last and "beside the model" in last     # not "not regular file"


def test_check_says_when_onnxruntime_itself_cannot_run_the_model(tmp_path):
    # onnxruntime's CPU provider has no uint8 Add; TVM builds and runs it
    u8 = dict(elem=TensorProto.UINT8)
    path = _save(tmp_path / "u8.onnx", [helper.make_node("Add", ["x", "x"], ["y"])], [_vec("x", **u8)],
                 [_vec("y", **u8)])
    last = _refused("run", path, "--check", match="--check")
    assert "onnxruntime" in last and "could not run" in last


CHAIN = 3000


@pytest.fixture(scope="module")
def deep_chain():
    """A 1x32 input through CHAIN element-wise nodes (Relu, Neg, Add a constant, repeated), and
    the same chain in numpy."""
    c = np.linspace(-0.5, 0.5, 32, dtype="float32")
    steps = [lambda v: np.maximum(v, 0), np.negative, lambda v: v + c]
    nodes, prev = [], "x"
    for i in range(CHAIN):
        out = "y" if i == CHAIN - 1 else f"t{i}"
        op = ("Relu", "Neg", "Add")[i % 3]
        nodes.append(helper.make_node(op, [prev, "c"] if op == "Add" else [prev], [out], name=f"n{i}"))
        prev = out
    graph = helper.make_graph(nodes, "chain", [_vec("x", shape=(1, 32))], [_vec("y", shape=(1, 32))],
                              [helper.make_tensor("c", TensorProto.FLOAT, [32], c)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])

    def reference(x):
        for i in range(CHAIN):
            x = steps[i % 3](x)
        return x

    return model, reference


@pytest.mark.parametrize("fusion", [pytest.param("tvm", marks=pytest.mark.slow), "souffle"])   # tvm: ~11 s, not ours
def test_a_deep_element_wise_chain_compiles_and_runs_with_either_fusion(deep_chain, fusion):
    from souffle_tvm.pipeline.driver import compile as compile_model

    model, reference = deep_chain
    compiled = compile_model(model, "llvm", fusion)
    x = np.random.default_rng(0).standard_normal((1, 32)).astype("float32")
    (y,) = runner.run_vm(compiled.executable, compiled.model.params, [x])
    np.testing.assert_allclose(y, reference(x), rtol=1e-6, atol=1e-6)


def test_the_vertical_transform_cuts_a_deep_chain_and_says_why(deep_chain):
    from souffle_tvm.frontend.importer import import_onnx
    from souffle_tvm.te import program as te_program
    from souffle_tvm.transforms.vertical import MAX_COMPOSED, vertical

    m = import_onnx(deep_chain[0])
    v = vertical(te_program.lower(m.mod, weight_values=m.params))
    cuts = [why for why in v.kept.values() if f"at most {MAX_COMPOSED}" in why]
    assert len(cuts) == (CHAIN - 1) // MAX_COMPOSED and len(v.inlined) + len(v.kept) == CHAIN


@pytest.mark.parametrize("args, option", [
    (("run", "mmoe", "--time", "-5"), "--time"), (("run", "mmoe", "--time", "0"), "--time"),
    (("run", "mmoe", "--seed", "-1"), "--seed"), (("run", "mmoe", "--tolerance", "0"), "--tolerance"),
    (("run", "mmoe", "--tolerance", "nan"), "--tolerance"), (("run", "mmoe", "--tolerance", "x"), "--tolerance"),
    (("compile", "mmoe", "--gemm-k-tile", "-16"), "--gemm-k-tile"), (("analyze", "mmoe", "--rows", "-1"), "--rows"),
    (("report", "r.json", "--rows", "two"), "--rows"), (("tune", "mmoe", "--database", "db", "--trials", "0"), "--trials"),
    (("tune", "mmoe", "--database", "db", "--max-stages", "0"), "--max-stages"),
    (("compile", "mmoe", "--fusion", "nope"), "--fusion")])
def test_a_numeric_option_out_of_range_is_refused_in_one_line(args, option, capsys):
    """Every numeric option is checked where it is parsed: exit 2 and one line naming the option
    and the command's --help, before any work (``run --time -5`` used to be accepted)."""
    from souffle_tvm import cli

    with pytest.raises(SystemExit) as stop:
        cli.main(list(args))
    lines = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("souffle-tvm: error: argument " + option) and f"souffle-tvm {args[0]} --help" in lines[0]


def test_the_numeric_options_take_their_least_value():
    from souffle_tvm import cli

    parsed = cli.build_parser().parse_args(["run", "mmoe", "--time", "1", "--seed", "0", "--tolerance", "1e-9"])
    assert (parsed.time, parsed.seed, parsed.tolerance) == (1, 0, 1e-9)
