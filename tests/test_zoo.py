"""The zoo: the paper's six models at the artifact's configurations, plus small variants."""

import collections

import onnx
import pytest

from souffle_tvm import zoo
from souffle_tvm.zoo import bert, efficientnet, lstm, mmoe, resnext, swin


def ops(model):
    return collections.Counter(n.op_type for n in model.graph.node)


def test_full_configurations_are_the_papers():
    assert (bert.FULL.layers, bert.FULL.seq, bert.FULL.hidden, bert.FULL.heads, bert.FULL.batch) == (12, 384, 768, 12, 1)
    assert resnext.FULL.blocks == (3, 4, 23, 3) and resnext.FULL.image == 224
    assert (lstm.FULL.layers, lstm.FULL.steps, lstm.FULL.hidden) == (10, 100, 256)
    assert efficientnet.FULL.stages == efficientnet.B0_STAGES and efficientnet.FULL.image == 224
    assert (swin.FULL.embed, swin.FULL.depths, swin.FULL.heads, swin.FULL.window) == (128, (2, 2, 18, 2), (4, 8, 16, 32), 7)
    assert (mmoe.FULL.features, mmoe.FULL.units, mmoe.FULL.experts, mmoe.FULL.tasks) == (100, 16, 8, 2)


@pytest.mark.parametrize("name", zoo.names())
def test_small_model_is_valid_and_has_the_full_models_op_forms(name):
    small = zoo.build(name, small=True)
    onnx.checker.check_model(small, full_check=True)
    full_ops = set(ops(zoo.build(name)) if name in ("lstm", "mmoe", "efficientnet") else ())
    if full_ops:  # cheap to build in full: same set of operator types
        assert set(ops(small)) == full_ops


def test_op_forms_real_exporters_emit():
    b = ops(zoo.build("bert", small=True))
    # per layer: Q, K, V, O and the two FFN linears, Q K^T and P V
    assert b["LayerNormalization"] == 4 and b["Erf"] == 2 and b["Softmax"] == 2 and b["MatMul"] == 2 * 8
    r = ops(zoo.build("resnext", small=True))
    grouped = [n for n in zoo.build("resnext", small=True).graph.node if n.op_type == "Conv"
               and any(a.name == "group" and a.i > 1 for a in n.attribute)]
    assert grouped and r["Gemm"] == 1 and r["MaxPool"] == 1
    assert ops(zoo.build("lstm", small=True))["LSTM"] == 2
    s = ops(zoo.build("swin", small=True))
    assert s["Gather"] >= 4 and s["Slice"] > 0 and s["Softmax"] == 4
    e = ops(zoo.build("efficientnet", small=True))
    # Counted from SMALL's stages (4 MBConv blocks, the first without expansion): a SiLU after the
    # stem, each expansion, each depthwise conv, each squeeze-excite reduction and the head, plus
    # the excitation's Sigmoid: 1 + 3 + 3 * 4 + 1; a pool per squeeze-excite and the head's; convs:
    # stem, 4 + 3 * 5 in the blocks (expand, depthwise, 2 squeeze-excite, project), head.
    assert e["Sigmoid"] == 17 and e["GlobalAveragePool"] == 4 + 1 and e["Conv"] == 1 + 4 + 3 * 5 + 1
    m = ops(zoo.build("mmoe", small=True))
    assert m["Gemm"] == 4 + 2 * 3 and m["Softmax"] == 2


def test_lstm_full_has_ten_layer_nodes_of_hidden_256():
    model = zoo.build("lstm")
    nodes = [n for n in model.graph.node if n.op_type == "LSTM"]
    assert len(nodes) == 10
    assert all(next(a.i for a in n.attribute if a.name == "hidden_size") == 256 for n in nodes)
    assert [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim] == [100, 1, 256]


def test_fp16_variants_and_seeded_weights():
    m16 = zoo.build("bert", small=True, dtype="float16")
    assert m16.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    assert zoo.build("mmoe", small=True).SerializeToString() == zoo.build("mmoe", small=True).SerializeToString()
    assert zoo.build("mmoe", small=True, seed=1).SerializeToString() != zoo.build("mmoe", small=True).SerializeToString()
    with pytest.raises(ValueError, match="float16"):
        zoo.build("resnext", dtype="float16")
    with pytest.raises(KeyError, match="unknown zoo model"):
        zoo.build("gpt5")
