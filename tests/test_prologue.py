"""Prologues (partition.kernels): a cheap one-to-one stage read only by the contraction after it,
whose large input comes from an earlier kernel, runs as that contraction's operand copy instead
of as an epilogue of the kernel that made its small input. EfficientNet's squeeze-excite scale
``x * s`` is applied as the projection GEMM loads its tile: the scaled tensor never exists in
global memory. Checked against onnxruntime in three block orders with the race checker."""

import pytest
from tvm import te

from conftest import race_checked_in_orders
from souffle_tvm import compile as souffle_compile
from souffle_tvm.cost import tir_stats
from souffle_tvm.core.ir_names import FORM_ATTR
from souffle_tvm.core.targets import make_target
from souffle_tvm.frontend.importer import import_onnx
from souffle_tvm.partition import kernels
from souffle_tvm.partition.groups import outputs_of, readers_of
from souffle_tvm.planning.fused_or_alone import why_not_fused
from souffle_tvm.planning.schedules import ScheduleCache
from souffle_tvm.pipeline import results as pipeline
from souffle_tvm.pipeline.options import Options
from souffle_tvm.stitch import lower
from test_row_chain import _program

CUDA = make_target("cuda")


@pytest.fixture(scope="module")
def effnet():
    return _program("efficientnet")


def _prologue_groups(part):
    return [g for g in part.groups if g.prologue]


def test_the_squeeze_excite_scale_is_the_projection_s_prologue(effnet):
    """Each MBConv block with squeeze-excite: its scale joins the projection, not the excite's
    second FC (which then writes the small scale only)."""
    part = kernels.partition_groups(effnet)
    found = _prologue_groups(part)
    blocks = sum(m.op.name.startswith("group_conv2d") for g in part.groups for m in g.members)  # depthwise convs
    assert len(found) == blocks >= 4, [g.reason for g in found]
    readers = readers_of(effnet)
    for g in found:
        scale, gemm = g.members[0], g.anchor
        assert g.reason.startswith("prologue:") and gemm.op.name.startswith("conv2d_nchw"), g.reason
        assert readers[scale.op] == {gemm.op}
        assert not any(o.op.same_as(scale.op) for o in outputs_of(g, readers))   # never written to global memory
        fc = next(h for h in part.groups if any(m.op in {x.op for x in scale.op.input_tensors} for m in h.members))
        assert scale.op not in {m.op for m in fc.members}


def _gemm(x):
    k = te.reduce_axis((0, 8), "k")
    w = te.placeholder((16, 8), name="w")
    return te.compute((16, 32), lambda n, m: te.sum(w[n, k] * x[k, m], axis=k), name="gemm")


def test_only_a_contraction_s_operand_takes_a_prologue():
    """A GEMM operand is broadcast along an output axis; a depthwise window reads every output
    axis (its reuse is the window's overlap, a prologue would be recomputed per tap)."""
    x = te.placeholder((8, 32), name="x")
    s = te.placeholder((8, 1), name="s")
    scaled = te.compute((8, 32), lambda c, m: x[c, m] * s[c, 0], name="scaled")
    assert kernels._contraction_operand(_gemm(scaled).op, scaled)
    r = te.reduce_axis((0, 3), "r")
    window = te.compute((8, 30), lambda c, m: te.sum(scaled[c, m + r], axis=r), name="dw")
    assert not kernels._contraction_operand(window.op, scaled)


def test_a_prologue_needs_its_large_input_from_an_earlier_kernel():
    """An element-wise stage over the group's own large output (a GELU before the next GEMM)
    stays an epilogue: as a prologue it would be recomputed per block column and its input
    still written; a costly body stays too."""
    x = te.placeholder((8, 32), name="x")
    s = te.placeholder((8, 1), name="s")
    prod = te.compute((8, 32), lambda c, m: x[c, m] + 1.0, name="prod")
    small = te.compute((8, 1), lambda c, _: s[c, 0] * 2.0, name="small")
    scaled = te.compute((8, 32), lambda c, m: prod[c, m] * small[c, 0], name="scaled")
    gemm = _gemm(scaled)
    readers = {scaled.op: {gemm.op}}
    assert kernels._prologue(scaled, gemm, readers, {small.op}, set())          # the large input is earlier
    assert not kernels._prologue(scaled, gemm, readers, {prod.op, small.op}, set())
    assert not kernels._prologue(scaled, gemm, {scaled.op: {gemm.op, prod.op}}, {small.op}, set())  # read twice
    costly = te.compute((8, 32), lambda c, m: te.exp(prod[c, m] * small[c, 0] + 1.0) * 3.0 - 2.0, name="costly")
    assert not kernels._prologue(costly, _gemm(costly), {costly.op: set()}, {small.op}, set())


def test_the_prologue_is_inlined_into_the_gemm_s_operand_copy(effnet):
    """On CUDA each prologue group schedules as the SIMT GEMM alone would, as one kernel: the
    scale is computed in the shared-memory copy (no second launch region writing it)."""
    part = kernels.partition_groups(effnet)
    readers = readers_of(effnet)
    cache = ScheduleCache(CUDA, 256)
    for g in _prologue_groups(part):
        func, _ = cache.group_funcs(g, outputs_of(g, readers))
        done = cache(func)
        assert str(done.func.attrs[FORM_ATTR]).startswith("StitchedMatmul@256"), done.func.attrs[FORM_ATTR]
        assert why_not_fused(cache, g, outputs_of(g, readers), readers) is None
        [_] = lower.lower_stage(g.name, done.func, CUDA)
        assert not tir_stats.global_scratch_buffers(done.func)


def test_small_efficientnet_with_prologues_fewer_bytes_and_launches(monkeypatch):
    """The default level: each prologue removes the excite's second kernel (the scale write) and
    the scaled tensor's round trip, counted by the emulator as the analytic bytes say."""
    with_p = souffle_compile("efficientnet", "cuda", "souffle", small=True, nvcc=False, count_traffic=True).report
    monkeypatch.setattr(kernels, "_prologue", lambda *a, **k: False)
    without = souffle_compile("efficientnet", "cuda", "souffle", small=True, nvcc=False).report
    n = sum(g["reason"].startswith("prologue:") for g in with_p.groups)
    assert n >= 4 and not any(g["reason"].startswith("prologue:") for g in without.groups)
    assert with_p.launches == without.launches - n
    assert with_p.bytes < 0.9 * without.bytes, (with_p.bytes, without.bytes)
    # every kernel's analytic bytes as the emulator counted them (the build without prologues is
    # the default level's of the weeks before: tests/test_traffic.py counted it then)
    assert not with_p.counted["differences"], with_p.counted["differences"]


def test_small_efficientnet_matches_onnxruntime_in_three_block_orders():
    m = import_onnx("efficientnet", small=True)
    souffle = pipeline.run(m.mod, CUDA, m.params, Options(level="auto").resolved())
    assert any(g.prologue for g in souffle.partition.groups)
    for order, report, comparisons in race_checked_in_orders(m, souffle, ("ascending", "descending", "shuffle:3")):
        assert report.ok, (order, str(report))
        for cmp in comparisons:
            assert cmp.finite and cmp.rel_l2 < 1e-5, (order, cmp)
