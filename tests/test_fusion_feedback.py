"""Schedule feedback on fusion (``planning.fused_or_alone.why_not_fused``): a group is
split where fusing lowers the rule its anchor gets alone, and where fusing takes the anchor's
parallelism away and the latency model predicts the group slower as one kernel than as two
(the full LSTM's last step of each layer: its gate epilogue reads four gate columns, so the
fused GEMV ran in ONE block, 216 us predicted against 6.5 us as two kernels)."""

from tvm import te, tirx

from souffle_tvm.core.targets import make_target
from souffle_tvm.partition.groups import Group
from souffle_tvm.planning.fused_or_alone import why_not_fused
from souffle_tvm.planning.schedules import ScheduleCache

CUDA = make_target("cuda")


def _gemv_then(epilogue):
    x, w = te.placeholder((1, 256), name="x"), te.placeholder((256, 1024), name="W")
    k = te.reduce_axis((0, 256), "k")
    gates = te.compute((1, 1024), lambda i, j: te.sum(x[i, k] * w[k, j], axis=k), name="matmul")
    out = epilogue(gates)
    return Group([gates, out]), out, {gates.op: {out.op}, out.op: {None}}


def _lstm_cell(gates):
    """h = sigmoid(i) * tanh(g) + sigmoid(f): each output reads three of the four gate columns."""
    return te.compute((1, 256), lambda i, j: tirx.sigmoid(gates[i, j]) * tirx.tanh(gates[i, j + 512])
                      + tirx.sigmoid(gates[i, j + 256]), name="cell")


def test_a_fused_group_predicted_slower_than_two_kernels_is_split():
    group, out, readers = _gemv_then(_lstm_cell)
    cache = ScheduleCache(CUDA, 256)
    why = why_not_fused(cache, group, [out], readers)
    assert why is not None and "predicts one kernel slower" in why and "matmul then cell" in why
    assert why_not_fused(cache, group, [out]) is None        # the rank check alone keeps it


def test_an_epilogue_that_keeps_the_parallelism_stays_fused():
    group, out, readers = _gemv_then(lambda g: te.compute((1, 1024), lambda i, j: tirx.tanh(g[i, j]), name="act"))
    assert why_not_fused(ScheduleCache(CUDA, 256), group, [out], readers) is None
