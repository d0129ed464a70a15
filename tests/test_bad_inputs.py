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
    code, _, err = _cli(*args)
    last = err.strip().splitlines()[-1] if err.strip() else ""
    assert code == 2, err[-1500:]
    assert "Traceback" not in err and last.startswith("souffle-tvm: error:") and match in last, err[-1500:]
    return last


@pytest.fixture(scope="module")
def mmoe(tmp_path_factory):
    path = tmp_path_factory.mktemp("bad") / "mmoe.onnx"
    onnx.save(zoo.build("mmoe", small=True), str(path))
    return str(path)


def test_a_huge_dynamic_shape_is_refused_with_the_bytes_it_needs(tmp_path, mmoe):
    model = onnx.load(mmoe)
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "batch"
    path = str(tmp_path / "dyn.onnx")
    onnx.save(model, path)
    last = _refused("run", path, "--input-shapes", "features:100000000000x32", match="TiB")
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
