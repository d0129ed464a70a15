"""Waves in a stitched kernel (``stitch.waves``): independent stages side by side on their own
lanes, one barrier per wave; a stacked LSTM as a wavefront (with ``transforms.step_slices``)."""

import dataclasses

import pytest

from souffle_tvm.core.ir_names import STAGE_LANE
from souffle_tvm.core.targets import make_target
from souffle_tvm.partition import subprograms
from souffle_tvm.frontend.importer import import_onnx
from souffle_tvm.pipeline import results as pipeline
from souffle_tvm.pipeline.options import Options
from souffle_tvm.stitch import dependence, kernel, kernel_ir, ramps, rolling, waves
from souffle_tvm.zoo import lstm
from conftest import emulated_comparisons, race_checked_in_orders
from test_lstm import lstm_model

CUDA = make_target("cuda")
WAVES = Options(level="v3", waves=True)      # step takes moved: a stacked recurrence's cells form waves


def test_levels_put_each_stage_one_after_what_it_depends_on():
    # two chains a0 -> a1 -> a2 and b0 -> b1 given one after the other; c overwrites what a1 read
    args = [["x", "a0"], ["a0", "a1"], ["a1", "a2"], ["y", "b0"], ["b0", "b1"], ["a0"]]
    access = [([True, False], [False, True]), ([True, False], [False, True]), ([True, False], [False, True]),
              ([True, False], [False, True]), ([True, False], [False, True]), ([False], [True])]
    assert waves.levels(args, access) == [0, 1, 2, 0, 1, 2]
    plan = waves.schedule(args, access, [3, 2, 1, 4, 1, 5], grid=8)
    assert plan.order == [0, 3, 1, 4, 2, 5]
    # a chain stays on its blocks where they are free (b1 on b0's lane 3, a1 and a2 on a0's);
    # a stage with no producer starts where the wave's placed stages end (c after a2)
    assert plan.lanes == [0, 3, 0, 3, 0, 1]
    # with every dependence block-local, each chain is one strand in one wave
    local = waves.levels(args, access, crosses=lambda j, i, k: False)
    assert local == [0, 0, 0, 0, 0, 1]


def _souffle(model, options: Options = WAVES):
    m = import_onnx(model)
    return m, pipeline.run(m.mod, CUDA, m.params, options)


def _lanes(func) -> list[int]:
    return [int(s.annotations.get(STAGE_LANE, 0)) for s in kernel_ir.stage_loops(rolling.unroll(func))
            if hasattr(s, "annotations") and "souffle.stage_blocks" in s.annotations]


def _checked(m, souffle):
    for c in emulated_comparisons(m, souffle.mod, souffle.params):
        assert c.finite and c.rel_l2 < 1e-5, f"emulated {c.name}: {c.rel_l2:.2e}"
    for order, report, comparisons in race_checked_in_orders(m, souffle):
        assert report.ok, f"{order}: {report}"
        assert all(c.rel_l2 < 1e-5 for c in comparisons), order


STACKED = lstm.LSTMConfig(layers=2, steps=8, hidden=16, features=16, batch=1)   # the full model's batch


@pytest.fixture(scope="module")
def stacked():
    return _souffle(lstm.build(STACKED))


def test_a_stacked_lstm_is_one_wavefront_kernel(stacked, monkeypatch):
    m, souffle = stacked
    [k] = souffle.stitched
    layers, steps = STACKED.layers, STACKED.steps
    # layer by layer (the order the partitioner gives) the same stages need a grid sync a cell;
    # by waves the cells of both layers share them: one a wave (layers + steps - 1 waves),
    # and one after the first layer's input projection
    monkeypatch.setattr(kernel, "_by_waves", lambda *a, **kw: None)
    [serial] = pipeline.run(m.mod, CUDA, m.params, WAVES).stitched
    assert sorted(serial.stages) == sorted(k.stages)
    assert serial.grid_syncs >= layers * steps
    assert k.grid_syncs <= layers + steps < serial.grid_syncs
    assert k.safety.ok
    # the waves are one loop, its lanes in its body: the steady ones and, under guards, the ramp
    # waves beside them that hold a steady cell (``stitch.ramps``). Each layer's first step
    # (its h0 term folded) and last are cells of their own, so the waves holding nothing else
    # stay written out: 5 of 9 waves in the loop, 33 of 51 stage loops written. Every stage is
    # in its wave: the loop's guards resolved, the kernel runs the waves the stitcher ordered.
    # (``written_out`` counts a fused loop's stages each: the cells of one layer's wave.)
    func = souffle.mod[k.function]
    [rolled] = [s for s in kernel_ir.stage_loops(func) if hasattr(s, "annotations") and rolling.ROLLED in s.annotations]
    assert int(rolled.extent) >= steps - layers - 1 and any(_lanes(func))
    assert k.written_out <= len(k.stages) - 2 * 4 * STACKED.layers    # two waves of 4-stage cells at least
    assert len(kernel_ir.flat_stages(rolling.unroll(func))) >= len(k.stages)
    _checked(m, souffle)


def test_a_ramp_stage_guarded_at_the_wrong_wave_is_caught(monkeypatch):
    """A stage that runs at one ramp wave alone (a variant) guarded at the wave after it: its
    wave loses it and the next runs it beside stages it is not ordered with. The static check
    sees the unrolled waves (``rolling.unroll`` resolves the guards) and refuses the kernel."""
    plain = ramps._guarded

    def late(stmts, waves, n0, n1, t):
        return plain(stmts, [w + 1 for w in waves] if len(waves) == 1 else waves, n0, n1, t)

    monkeypatch.setattr(ramps, "_guarded", late)
    with pytest.raises(Exception, match="unsafe stitched kernel"):
        _souffle(lstm.build(STACKED))


def _bidirectional():
    # batch 16, hidden 64: the cell's stages have several tiles, so a lane moves real work
    return lstm_model(seq=4, batch=16, d_in=8, hidden=64, direction="bidirectional")


def test_bidirectional_directions_run_side_by_side():
    m, souffle = _souffle(_bidirectional(), Options(level="v3"))     # no step takes to move: the default
    [k] = souffle.stitched
    assert k.safety.ok and any(_lanes(souffle.mod[k.function]))
    # the directions' steps share segments (between grid syncs), each on its own lanes: one
    # direction after the other would share none (that kernel, built with ``kernel._by_waves``
    # monkeypatched away, had 14 grid syncs against these 8)
    lanes = {}
    for segment, lane in k.phases:
        lanes.setdefault(segment, set()).add(lane)
    assert sum(len(held) > 1 for held in lanes.values()) >= 4       # one per step at least
    _checked(m, souffle)


@pytest.mark.slow      # (the default suite's time: ~25 s)
def test_lanes_ignored_by_the_dependence_proof_are_caught(monkeypatch):
    """The planted fault: a dependence across lanes proved block-local as if both stages ran vb
    on one block. The stitcher then leaves out grid syncs the kernel needs; the emulator or the
    race checker must see it (the static check asks the same faulty proof)."""
    real = dependence.barrier_needed
    monkeypatch.setattr(dependence, "barrier_needed",
                        lambda w, wb, r, rb: real(dataclasses.replace(w, lane=0), wb, dataclasses.replace(r, lane=0), rb))
    # (one-tile cells: where the proof's one-block rule would call a cross-lane dependence local)
    m, souffle = _souffle(lstm_model(seq=6, batch=2, d_in=8, hidden=16, direction="bidirectional"))
    monkeypatch.setattr(dependence, "barrier_needed", real)
    bad = [c for c in emulated_comparisons(m, souffle.mod, souffle.params) if not c.rel_l2 < 1e-5]
    races = [r for _, r, _ in race_checked_in_orders(m, souffle) if not r.ok]
    assert bad or races


@pytest.mark.slow      # (the default suite's time: ~11 s; the ramp guard's fault stays in it)
def test_a_lane_dropped_from_a_stage_body_is_caught(monkeypatch):
    """The planted fault: a stage's blocks walked from its lane (its trip count) but its tiles
    indexed from block 0: tiles go missing."""
    real = kernel._stage_body
    monkeypatch.setattr(kernel, "_stage_body",
                        lambda st, view, *a: real(st, dataclasses.replace(view, lane=0), *a))
    m, souffle = _souffle(_bidirectional())
    bad = [c for c in emulated_comparisons(m, souffle.mod, souffle.params) if not c.rel_l2 < 1e-5]
    assert bad


@pytest.mark.slow      # ~35 s each (the default suite's time); the wave tests above cover the forms
@pytest.mark.parametrize("name", ["lstm", "gru"])
def test_real_exports_form_waves(name, monkeypatch):
    """PyTorch's own exports: a 2-layer LSTM (stacked: the step takes move to layer 0's concat)
    and a bidirectional GRU (its directions side by side)."""
    import torch_models as tm

    m = import_onnx(tm.export(name, "legacy"), shapes=tm.input_shapes(name))
    souffle = pipeline.run(m.mod, CUDA, m.params, WAVES)
    assert all(k.safety.ok for k in souffle.stitched)
    monkeypatch.setattr(kernel, "_by_waves", lambda *a, **kw: None)
    serial = pipeline.run(m.mod, CUDA, m.params, WAVES).stitched
    assert sum(k.grid_syncs for k in souffle.stitched) < sum(k.grid_syncs for k in serial)
    monkeypatch.undo()
    _checked(m, souffle)


def test_a_wave_is_priced_as_its_slowest_stage(stacked):
    """Stages of one phase run at once: the kernel takes the slowest, not the sum (a planted
    ``in_phases`` that adds them up fails here)."""
    from souffle_tvm.cost import hardware, latency
    from souffle_tvm.cost.work import Stage

    gpu = hardware.for_arch("sm_90")
    stage = Stage(4, 256, 1 << 20, 1 << 20)
    two = latency.Kernel("k", 8, 256, 64, 0, (stage, stage), grid_syncs=1)
    alone = latency.kernel_time(gpu, latency.FITTED, dataclasses.replace(two, stages=(stage,)))   # the same sync
    serial = latency.kernel_time(gpu, latency.FITTED, two)
    beside = latency.kernel_time(gpu, latency.FITTED, dataclasses.replace(two, phases=((0, 0), (0, 4))))
    after = latency.kernel_time(gpu, latency.FITTED, dataclasses.replace(two, phases=((0, 0), (0, 0))))
    assert after.seconds == pytest.approx(serial.seconds)       # one lane: one after the other
    assert beside.seconds == pytest.approx(alone.seconds)
    assert beside.seconds < serial.seconds
    # the stacked LSTM's kernel records its waves' lanes: some segment runs two side by side
    [k] = stacked[1].stitched
    assert len(k.phases) == len(k.stages) and any(lane for _, lane in k.phases)


def test_waves_where_they_cannot_apply_are_refused():
    """``waves`` moves step takes for the budget partitioner's stitched kernels: on llvm, at
    level auto (the time partitioner, which does not price waves) or below v3 it is refused in
    one line, never ignored."""
    from souffle_tvm.errors import OptionsError

    for options, target in ((WAVES, make_target("llvm")), (Options(level="auto", waves=True), CUDA),
                            (Options(level="v2", waves=True), CUDA)):
        with pytest.raises(OptionsError, match="waves") as err:
            options.check(target)
        assert "\n" not in str(err.value)


@pytest.mark.slow      # (the default suite's time: ~25 s)
def test_a_deep_stack_whose_waves_do_not_roll_keeps_the_layer_order():
    """Ten layers: the wave kernel's first and last waves stay written out (more stage loops than
    the partitioner sizes a kernel for), and with the step takes moved the layers' steps do not
    roll either: the pipeline runs again without waves rather than build that."""
    m = import_onnx(lstm.build(lstm.LSTMConfig(layers=10, steps=6, hidden=16, features=16, batch=1)))
    souffle = pipeline.run(m.mod, CUDA, m.params, WAVES)
    plain = pipeline.run(m.mod, CUDA, m.params, Options(level="v3"))
    assert souffle.options.waves is False
    assert [(k.stages, k.grid_syncs) for k in souffle.stitched] == [(k.stages, k.grid_syncs) for k in plain.stitched]


def test_a_wave_kernel_with_guarded_ramps_builds_with_nvcc():
    """The stacked LSTM's wave kernel through TVM's TIR pipeline and nvcc (sm_90): its guards are
    trip counts, so ThreadSync may place block barriers inside guarded stages (it refuses to
    under an ``if``); no spills, the grid co-resident, one grid sync a wave."""
    from souffle_tvm.pipeline.driver import compile as compile_model
    c = compile_model(lstm.build(STACKED), "cuda", "souffle", level="v3", waves=True)
    [k] = [k for k in c.report.kernels if k.cooperative]
    assert k.spill_bytes == 0 and k.grid[0] <= k.max_coresident
    assert k.grid_syncs == STACKED.layers + STACKED.steps


def test_with_waves_the_budget_counts_a_cells_code_once():
    """``code_repeats``: a group repeats the latest earlier group of the same code wherever it
    is (a recurrence's step t and t+1 differ only in constants), so the compile-time budget
    counts each distinct cell once; groups without code never repeat."""
    facts = subprograms.GroupFacts([None] * 6, code=["a", "b", "a", "c", "b", None])
    assert subprograms.code_repeats(facts).repeat_of == [None, None, 0, None, 1, None]
    assert subprograms.code_repeats(subprograms.GroupFacts([None])).repeat_of == []

