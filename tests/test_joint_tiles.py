"""Joint tiling (planning.joint_tiles, codegen.rules.AlignedTiles): an elementwise group cut into
its producer's blocks where its block b then reads only what the producer's block b wrote. The
LSTM's cell update (its gates interleaved by unit, frontend.onnx_rnn) follows the recurrent
GEMV's tiles: one grid sync a step instead of two, the gates kept on chip. Race-checked in three
block orders against onnxruntime."""

import pytest
from tvm import tirx
from tvm.script import tirx as T

from conftest import race_checked_in_orders
from souffle_tvm.codegen import schedule
from souffle_tvm.core.ir_names import ALIGNED_TILES_ATTR
from souffle_tvm.core.targets import make_target
from souffle_tvm.frontend.importer import import_onnx
from souffle_tvm.planning import joint_tiles
from souffle_tvm.pipeline import results as pipeline
from souffle_tvm.pipeline.options import Options
from souffle_tvm.stitch import lower
from souffle_tvm.zoo import lstm as lstm_zoo

CUDA = make_target("cuda")
LAYERS, STEPS = 2, 8


@pytest.fixture(scope="module")
def lstm():
    """The small LSTM at batch 1, as the full one runs (its recurrent product a GEMV)."""
    m = import_onnx(lstm_zoo.build(lstm_zoo.LSTMConfig(layers=LAYERS, steps=STEPS, hidden=16, features=16, batch=1)))
    return m, pipeline.run(m.mod, CUDA, m.params, Options(level="v3"))


def test_the_cell_update_runs_in_the_gemv_blocks_one_grid_sync_a_step(lstm, monkeypatch):
    """Each step's cell update and hidden state take the GEMV's 4 blocks (4 units, 16 gates a
    block): the kernel syncs the grid once a step, against twice with the groups tiled alone, and
    one more for the second layer's first product. (A layer's first step reads the input
    projection, whose tiles span steps; at batch 1 its stages there have one block each, ordered
    by a block barrier.)"""
    m, souffle = lstm
    [sk] = souffle.stitched
    forms = {s: str(souffle.unstitched[s].attrs["souffle.form"]) for s in set(sk.stages)}
    assert sum(f.startswith("AlignedTiles") for f in forms.values()) >= 2, forms
    assert sk.grid_syncs == LAYERS * STEPS + 1, sk.grid_syncs
    monkeypatch.setattr(joint_tiles, "align", lambda *a, **k: {})
    [alone] = pipeline.run(m.mod, CUDA, m.params, Options(level="v3")).stitched
    assert alone.grid_syncs >= 2 * LAYERS * (STEPS - 1), (alone.grid_syncs, sk.grid_syncs)     # twice a step after the first


def test_the_aligned_kernel_matches_onnxruntime_in_three_block_orders(lstm):
    m, souffle = lstm
    for order, report, comparisons in race_checked_in_orders(m, souffle, ("ascending", "descending", "shuffle:3")):
        assert report.ok, (order, str(report))
        for cmp in comparisons:
            assert cmp.finite and cmp.rel_l2 < 1e-5, (order, cmp)


@T.prim_func(s_tir=True)
def _update(g: T.Buffer((T.int64(1), T.int64(64)), "float32"), c: T.Buffer((T.int64(1), T.int64(16)), "float32")):
    for i, u in T.grid(T.int64(1), T.int64(16)):
        with T.sblock("c"):
            vi, vu = T.axis.remap("SS", [i, u])
            c[vi, vu] = g[vi, vu * T.int64(4)] * g[vi, vu * T.int64(4) + T.int64(3)]


def test_aligned_tiles_cuts_only_what_it_was_asked_to():
    """The rule applies to a stamped elementwise function alone: 16 outputs in 4 blocks of 4
    threads; unstamped, or a count that does not divide the outputs, it passes."""
    stamped = _update.with_attr(ALIGNED_TILES_ATTR, tirx.IntImm("int32", 4))
    done = schedule.schedule_group(stamped, CUDA, 256)
    assert done.rule == "AlignedTiles"
    [st] = lower.lower_stage("c", done.func, CUDA)
    assert (st.num_blocks, st.num_threads) == (4, 4)
    assert schedule.schedule_group(_update, CUDA, 256).rule != "AlignedTiles"
    odd = _update.with_attr(ALIGNED_TILES_ATTR, tirx.IntImm("int32", 3))
    assert schedule.schedule_group(odd, CUDA, 256).rule != "AlignedTiles"
    assert schedule.schedule_group(stamped, CUDA, None).rule != "AlignedTiles"     # built alone: ignored


def test_a_full_width_layer_stitched_whole_matches_onnxruntime():
    """One layer at the full model's width (hidden 256: 64 GEMV blocks of 16 gate columns, 4
    units a block), 6 steps, at ``--level v3``: its steps after the first stitched with the
    cell update block-local (one grid sync a step), race-checked in three orders. (The default
    level built this form until 2026-12-07; it now gives each step a kernel of its own at 512
    threads, tests/test_lstm_step_kernels.py.)"""
    m = import_onnx(lstm_zoo.build(lstm_zoo.LSTMConfig(layers=1, steps=6, hidden=256, features=256, batch=1)))
    souffle = pipeline.run(m.mod, CUDA, m.params, Options(level="v3"))
    [sk] = [k for k in souffle.stitched if len(k.stages) > 3]
    assert sum(str(souffle.unstitched[s].attrs["souffle.form"]).startswith("AlignedTiles") for s in set(sk.stages)) >= 2
    assert sk.grid_syncs <= len(sk.stages) // 3 + 1, (sk.grid_syncs, sk.stages)
    for order, report, comparisons in race_checked_in_orders(m, souffle, ("ascending", "descending", "shuffle:3")):
        assert report.ok, (order, str(report))
        for cmp in comparisons:
            assert cmp.finite and cmp.rel_l2 < 1e-5, (order, cmp)
