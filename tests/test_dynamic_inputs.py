"""Transformer exports with several int64 inputs and dynamic batch and sequence (issue 18, class 4).

``tests/torch_models.HFBert`` has the forms of transformers' BertModel: the attention mask is
expanded to [b, 1, s, s] with a shape computed from ``input_ids``, so once the shapes are
folded the ``Expand`` takes an int64 initializer, which TVM's importer took as a parameter and
turned into a dynamic-shape graph (``AssertionError: emit_te now only supports Tensor that has
ShapeExpr shape`` in ``_bind_integer_params``, with both fusions). The shapes come from the
arrays given to ``run --inputs``, at two (batch, sequence) sizes, through the CLI.
"""

from __future__ import annotations

import re

import numpy as np
import onnx
import pytest

import torch_models as tm
from souffle_tvm.frontend.importer import import_onnx

from conftest import module_cli as cli

SHAPES = [(2, 8), (3, 5)]
# The default run covers each fusion and each shape once, on the legacy export; the rest: slow.
DEFAULT = {("legacy-seq", "tvm", (3, 5)), ("legacy-seq", "souffle", (2, 8))}
CASES = [pytest.param(e, f, s, marks=() if (e, f, s) in DEFAULT else pytest.mark.slow, id=f"{e}-{f}-{s[0]}x{s[1]}")
         for e in ("legacy-seq", "dynamo-seq") for f in ("tvm", "souffle") for s in SHAPES]


@pytest.mark.parametrize("exporter", ["legacy-seq", "dynamo-seq"])
def test_export_has_three_dynamic_int64_inputs_and_a_shape_computed_expand(exporter):
    model = onnx.load(tm.export("hfbert", exporter))
    assert [i.name for i in model.graph.input] == ["input_ids", "attention_mask", "token_type_ids"]
    for vi in model.graph.input:
        tt = vi.type.tensor_type
        assert tt.elem_type == onnx.TensorProto.INT64
        assert all(not d.HasField("dim_value") for d in tt.shape.dim), vi   # batch and sequence dynamic
    ops = {n.op_type for n in model.graph.node}
    assert "Expand" in ops and "Shape" in ops


@pytest.mark.parametrize("exporter,fusion,shape", CASES)
def test_dynamic_transformer_runs_at_the_shapes_of_its_inputs(exporter, fusion, shape, tmp_path):
    path = tm.export("hfbert", exporter)
    batch, seq = shape
    np.savez(tmp_path / "in.npz", **tm.example_inputs("hfbert", seed=2, batch=batch, seq=seq))
    proc = cli("run", path, "--inputs", "in.npz", "--check", "--fusion", fusion, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert f"hidden: shape ({batch}, {seq}, 32)" in proc.stdout and f"pooled: shape ({batch}, 32)" in proc.stdout
    checks = [ln for ln in proc.stdout.splitlines() if ln.strip().startswith("check ")]
    assert len(checks) == 2
    for line in checks:
        assert float(re.search(r"rel L2 (\S+)", line).group(1)) < 1e-5, line


def test_integer_initializers_are_constants_to_the_importer():
    # The Expand's folded int64 shape must not become a parameter: main takes the three inputs
    # and float weights only, all of static shape.
    m = import_onnx(tm.export("hfbert", "legacy-seq"), shapes=tm.input_shapes("hfbert", 2, 6))
    func = m.mod["main"]
    assert int(func.attrs["num_input"]) == 3
    for p in func.params:
        assert p.ty.dtype in ("int64", "float32") and all(hasattr(d, "value") for d in p.ty.shape.values), p
    assert all(str(w.dtype) == "float32" for w in m.params)
