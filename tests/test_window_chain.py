"""Window chains (partition.kernels, codegen.rules.WindowChain): a contraction and the depthwise
convolution that reads it in one kernel, each block computing the contraction's tile its windows
read (halo included) into shared memory. EfficientNet's MBConv expand -> depthwise: the expanded
tensor never goes to global memory. Race-checked in three block orders, at small and full size,
against onnxruntime (the small model) and the unscheduled function on llvm (full-size kernels)."""

import numpy as np
import pytest
import tvm
from tvm import te

from conftest import race_checked_in_orders
from souffle_tvm import compile as souffle_compile
from souffle_tvm.codegen.rules import WindowChain
from souffle_tvm.codegen.rules.window_chain import _channels
from souffle_tvm.cost import tir_stats
from souffle_tvm.core.ir_names import FORM_ATTR
from souffle_tvm.core.targets import make_target
from souffle_tvm.frontend.importer import import_onnx
from souffle_tvm.partition import kernels
from souffle_tvm.partition.groups import outputs_of, readers_of
from souffle_tvm.planning.schedules import ScheduleCache
from souffle_tvm.pipeline import results as pipeline
from souffle_tvm.pipeline.options import Options
from souffle_tvm.runtime import races, traffic
from souffle_tvm.stitch import lower
from souffle_tvm.zoo import efficientnet
from test_row_chain import _program

CUDA = make_target("cuda")


def _windows(prog):
    part = kernels.partition_groups(prog)
    return part, [g for g in part.groups if g.window_at]


def test_every_expansion_and_its_depthwise_convolution_are_one_group():
    """Small EfficientNet: each expansion joined by the depthwise convolution that reads it."""
    prog = _program("efficientnet")
    part, found = _windows(prog)
    readers = readers_of(prog)
    depthwise = [m for g in part.groups for m in g.members if m.op.name.startswith("group_conv2d")]
    # each depthwise convolution whose input nothing else reads (the small model's first block
    # adds its input back: that input must reach global memory anyway)
    alone = [m for m in depthwise if all(readers[x.op] == {m.op} for x in m.op.input_tensors if x.op in readers)]
    assert len(found) == len(alone) >= 3 and len(depthwise) == 4
    for g in found:
        assert g.members[g.window_at].op.name.startswith("group_conv2d")
        assert g.anchor.op.name.startswith("conv2d_nchw") and g.window_reason.startswith("window chain:")
        expanded = g.members[g.window_at - 1]
        assert not any(o.op.same_as(expanded.op) for o in outputs_of(g, readers))  # the window's only
    # ResNeXt: its stem convolution and the 3 x 3 max pool after it (a window too); its grouped
    # 3 x 3 convolutions (4 input channels a group at full size) are not windows over (h, w) alone
    [stem] = _windows(_program("resnext", small=False))[1]
    assert [m.op.name for m in stem.members][stem.window_at] == "pool_max"


def test_a_window_chain_falls_apart_where_it_joined():
    prog = _program("efficientnet")
    _, found = _windows(prog)
    g = found[0]
    head, tail = kernels.split_unschedulable(g, "a reason")
    assert head.members == g.members[:g.window_at] and tail.members == g.members[g.window_at:]
    assert tail.reason.startswith("window chain not taken: a reason")


def test_channels_per_block():
    """The most channels whose tile fits half the static shared memory and that still give 132
    SMs a block each; at least a thread's output each where that fits."""
    assert _channels(96, 16, 29 * 29, 14 * 14, 256, 4, 132) == 6        # 7 would not fit; 96/6 x 16 = 256 blocks
    assert _channels(1152, 1, 49, 49, 256, 4, 132) == 8                # 8 x 49 >= 256; 144 blocks
    assert _channels(32, 1, 112 * 112, 112 * 112, 256, 4, 132) is None  # no tile fits


def test_the_rule_schedules_one_kernel_with_its_tile_in_shared_memory():
    prog = _program("efficientnet")
    part, found = _windows(prog)
    readers = readers_of(prog)
    cache = ScheduleCache(CUDA, 256)
    for g in found:
        func, _ = cache.group_funcs(g, outputs_of(g, readers))
        done = cache(func)
        assert str(done.func.attrs[FORM_ATTR]) == "WindowChain@256"
        [stage] = lower.lower_stage(g.name, done.func, CUDA)
        assert stage.num_threads == 256
        assert not tir_stats.global_scratch_buffers(done.func)
        assert "shared" in done.func.script()


def test_small_efficientnet_window_chains_counted_and_race_free():
    """At the default level: the window chains taken, the expanded tensors off global memory (the
    emulator's counted bytes equal the analytic ones on every kernel), and the model matches
    onnxruntime in three block orders without a race."""
    rep = souffle_compile("efficientnet", "cuda", "souffle", small=True, nvcc=False, count_traffic=True).report
    assert sum(k.form.startswith("WindowChain") for k in rep.kernels) >= 3
    assert not rep.counted["differences"], rep.counted["differences"]
    # and something was compared: every kernel ran in the emulator, each analytic figure held
    assert rep.kernels and all(k.counted for k in rep.kernels)
    held, _, compared, _ = rep.counted["analytic_held"].split()      # "N of M equal"
    assert int(held) == int(compared) >= len(rep.kernels), rep.counted
    m = import_onnx("efficientnet", small=True)
    souffle = pipeline.run(m.mod, CUDA, m.params, Options(level="auto").resolved())
    for order, report, comparisons in race_checked_in_orders(m, souffle, ("ascending", "descending", "shuffle:5")):
        assert report.ok, (order, str(report))
        for cmp in comparisons:
            assert cmp.finite and cmp.rel_l2 < 1e-5, (order, cmp)


@pytest.mark.parametrize("index", [1, 4])     # the second block, and the fifth
def test_a_full_size_window_chain_matches_the_unscheduled_function(index):
    """Full-size MBConv kernels (the second block: 16 -> 96 channels at 112 x 112, a 3 x 3
    depthwise at stride 2, tiles with halos and clipped borders; a 5 x 5 one at 28 x 28), emulated
    with the race checker in three orders, against the same group run unscheduled on llvm."""
    prog = _program("efficientnet", small=False)
    _, found = _windows(prog)
    g = found[index]
    func, _ = ScheduleCache(CUDA, 256).group_funcs(g, outputs_of(g, readers_of(prog)))
    scheduled = WindowChain(256).apply(func, CUDA, False)
    assert scheduled is not None
    args = races.arguments(func, seed=index)
    ref = [tvm.runtime.tensor(a) for a in args]
    tvm.compile(tvm.IRModule({"ref": func.with_attr("global_symbol", "ref")}), make_target("llvm"))["ref"](*ref)
    emu = races.Emulation(tvm.IRModule({"kernel": scheduled.mod["main"]}), CUDA)
    for order in ("ascending", "descending", "shuffle:2"):
        outs, report = emu.run([a.copy() for a in args], order=order)
        assert report.ok, (order, str(report))
        got, want = outs[-1], ref[-1].numpy()
        assert np.linalg.norm(got - want) <= 1e-5 * np.linalg.norm(want), order
    # the tile's phase loads each activation value once per pixel and input channel, for all the
    # tile's channels (each a shared store): not once per channel besides (8x the L1 sectors)
    [launch] = traffic.count(tvm.IRModule({"k": scheduled.mod["main"]}), CUDA, [a.copy() for a in args]).values()
    activation = max(launch.buffers, key=lambda b: b.distinct_read)
    [k] = {int(p.ty.shape[1]) for p in func.params if p.name == activation.name}
    assert 2 * activation.reads <= k * launch.shared["writes"], (activation, launch.shared)


def _depthwise_after(x, name):
    r, s = te.reduce_axis((0, 3), "r"), te.reduce_axis((0, 3), "s")
    return te.compute((1, 8, 6, 6), lambda n, c, h, w: te.sum(x[n, c, h + r, w + s], axis=[r, s]), name=name)


def test_only_a_window_over_the_innermost_axes_joins():
    """A window over (h, w) of the contraction's activation joins; a sum over input channels too
    (a dense 3 x 3) does not, nor a window read by another stage too, nor one reading the
    contraction itself (the rule computes the tile as the contraction's epilogue)."""
    x = te.placeholder((1, 4, 8, 8), name="x")
    k = te.reduce_axis((0, 4), "k")
    w = te.placeholder((8, 4), name="w")
    expand = te.compute((1, 8, 8, 8), lambda n, c, h, ww: te.sum(w[c, k] * x[n, k, h, ww], axis=k), name="expand")
    act = te.compute((1, 8, 8, 8), lambda *i: te.max(expand(*i), 0.0), name="act")
    group, members = kernels.Group([expand, act]), {expand.op, act.op}
    dw = _depthwise_after(act, "dw")
    assert kernels._window_chain(dw.op, group, members, {act.op: {dw.op}})
    assert not kernels._window_chain(dw.op, group, members, {act.op: {dw.op, x.op}})     # read twice
    direct = _depthwise_after(expand, "direct")
    assert not kernels._window_chain(direct.op, kernels.Group([expand]), {expand.op}, {expand.op: {direct.op}})
    rc, r, s = te.reduce_axis((0, 8), "rc"), te.reduce_axis((0, 3), "r"), te.reduce_axis((0, 3), "s")
    dense = te.compute((1, 8, 6, 6), lambda n, c, h, ww: te.sum(act[n, rc, h + r, ww + s], axis=[rc, r, s]),
                       name="dense")
    assert not kernels._window_chain(dense.op, group, members, {act.op: {dense.op}})


def test_one_full_size_mbconv_block_matches_onnxruntime_in_three_block_orders():
    """EfficientNet-B0's second block at full size (16 -> 96 -> 24 channels, 112 x 112 to 56 x 56,
    3 x 3 depthwise at stride 2, squeeze-excite), behind a stem at 224 x 224, at the default
    level: its expansion and depthwise convolution one kernel, its excite scale the projection's
    prologue; race-free in three block orders and equal to onnxruntime (fp32 1e-5)."""
    cfg = efficientnet.EfficientNetConfig(stages=((6, 24, 1, 2, 3),), image=224, stem=16, head=32, classes=10)
    m = import_onnx(efficientnet.build(cfg))
    souffle = pipeline.run(m.mod, CUDA, m.params, Options(level="auto").resolved())
    assert [g.window_at for g in souffle.partition.groups if g.window_at] and \
        any(g.prologue for g in souffle.partition.groups)
    forms = [str(f.attrs["souffle.form"]) for f in souffle.mod.functions.values()
             if isinstance(f, tvm.tirx.PrimFunc) and f.attrs is not None and "souffle.form" in f.attrs]
    assert any(f.startswith("WindowChain") for f in forms), forms
    for order, report, comparisons in race_checked_in_orders(m, souffle, ("ascending", "descending", "shuffle:7")):
        assert report.ok, (order, str(report))
        for cmp in comparisons:
            assert cmp.finite and cmp.rel_l2 < 1e-5, (order, cmp)


def test_a_stitched_window_chain_keeps_its_tile():
    """Level v3 stitches the block's expansion and depthwise convolution into a cooperative kernel
    that walks its tiles grid-stride. TVM's build must not compact that tile again
    (``build.compacted_once``): with the halo clipped at the map's borders, the second compaction
    could not bound it and grew it to the whole map (full-size EfficientNet-B0 at v3: 440 KB of
    static shared memory, which ptxas refused)."""
    cfg = efficientnet.EfficientNetConfig(stages=((6, 24, 1, 2, 3),), image=224, stem=16, head=32, classes=10)
    built = souffle_compile(efficientnet.build(cfg), "cuda", "souffle", level="v3", nvcc=True)
    stitched = [k for k in built.report.kernels if k.grid_syncs is not None and "WindowChain" in (k.form or "")]
    assert stitched, [(k.name, k.form) for k in built.report.kernels]
    for k in stitched:
        # the tile of 8-16 channels by (2 x 7 + 1)^2 pixels and its neighbours' stages: far under 48 KB
        assert k.shared_bytes is not None and k.shared_bytes < 48 * 1024, (k.name, k.shared_bytes)
