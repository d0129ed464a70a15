"""The time partitioner prices a group from what a block of its kernel executes (``cost.tir_counts``)
in the form it will be built in: alone, or as a stage of a stitched kernel (TVM's pipeline
places the barriers in both). Without the counts a GEMV whose K loop waits at a barrier every step was
priced by its bytes alone (2 us) and chosen, and the report then priced the built kernel by its
waits (8 us)."""

import pytest
import tvm
from tvm import te

from souffle_tvm.build import executable
from souffle_tvm.core.targets import make_target
from souffle_tvm.planning import block_counts
from souffle_tvm.planning.schedules import ScheduleCache
from souffle_tvm.stitch import lower

TARGET = make_target("cuda", "sm_90")


def _gemv(k: int = 256, n: int = 1024):
    h = te.placeholder((1, k), name="h")
    w = te.placeholder((k, n), name="w")
    r = te.reduce_axis((0, k), "r")
    out = te.compute((1, n), lambda i, j: te.sum(h[i, r] * w[r, j], axis=r), name="matmul")
    return te.create_prim_func([h, w, out])


def _gemm(m: int = 128, k: int = 128, n: int = 128):
    a = te.placeholder((m, k), name="a")
    b = te.placeholder((k, n), name="b")
    r = te.reduce_axis((0, k), "r")
    out = te.compute((m, n), lambda i, j: te.sum(a[i, r] * b[r, j], axis=r), name="matmul")
    return te.create_prim_func([a, b, out])


def _eltwise(n: int = 4096):
    x = te.placeholder((n,), name="x")
    y = te.compute((n,), lambda i: te.exp(x[i]) + 1.0, name="y")
    return te.create_prim_func([x, y])


def _recorded(func):
    """Block counts of the kernels the project's own build records (what the report reads)."""
    with executable.recording() as kernels:
        tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=TARGET,
                    tir_pipeline=executable.TIR_PIPELINE)
    return [k.counts for k in kernels]


@pytest.mark.parametrize("make,block", [(_gemv, 256), (_gemv, 512), (_gemv, None), (_gemm, 256), (_eltwise, None)],
                         ids=["gemv-256", "gemv-512", "gemv-v2", "gemm-256", "eltwise-v2"])
def test_alone_counts_are_the_built_kernels(make, block):
    func = make()
    scheduled = ScheduleCache(TARGET, block)(func).func
    counts = executable.device_counts(scheduled, TARGET)
    assert counts and counts == _recorded(scheduled)
    lowered = lower.lower_stage("g", scheduled, TARGET)
    work = block_counts.stage_work(scheduled, lowered, func, TARGET)
    assert [w.k_steps for w in work] == [c.k_steps for c in counts]
    assert [w.shared_wavefronts for w in work] == [c.shared_wavefronts for c in counts]


def test_a_gemv_k_loop_waits_alone_but_not_stitched():
    """dlight's column reduction at 512 threads: TVM's ThreadSync guards its K loop with a barrier
    each step when the kernel is built alone (8 steps waiting on global loads), not inside a
    stitched kernel, whose launch form the stitcher takes; the partitioner sees both."""
    func = _gemv()
    done = ScheduleCache(TARGET, 512)(func)
    assert done.rule == "ColumnReduction"
    lowered = lower.lower_stage("g", done.func, TARGET)
    alone = block_counts.stage_work(done.func, lowered, func, TARGET)
    stitched = block_counts.stage_work(done.func, lowered, func, TARGET, block=512)
    assert [w.k_steps for w in alone] == [8]
    assert [w.k_steps for w in stitched] == [0]
    # and the price follows: alone it waits 8 steps at the fitted step cost
    from souffle_tvm.cost import estimate, hardware, latency
    from souffle_tvm.partition import window_prices
    gpu = hardware.for_arch("sm_90")
    est = [estimate.stage(st.body) for st in lowered]
    waits = 8 * latency.FITTED.kstep_cycles / gpu.clock_hz
    assert window_prices.alone_seconds(gpu, latency.FITTED, alone, est) >= waits
    assert window_prices.alone_seconds(gpu, latency.FITTED, stitched, est) < waits


def test_the_partitioner_counts_the_grid_syncs_the_stitcher_puts():
    """A window's grid syncs are the stitched kernel's: a group that reads its producer
    block-locally (the LSTM's cell update, one tile, reading the gates' tile) follows it behind a
    block barrier, not a grid sync (``GroupFacts.local_producers``)."""
    import dataclasses

    from souffle_tvm.cost import hardware, latency
    from souffle_tvm.frontend.importer import import_onnx
    from souffle_tvm.partition import window_prices
    from souffle_tvm.partition.groups import readers_of
    from souffle_tvm.pipeline import results
    from souffle_tvm.pipeline.options import Options
    from souffle_tvm.zoo import lstm

    model = import_onnx(lstm.build(lstm.LSTMConfig(layers=2, steps=4, hidden=256, features=16, batch=1)))
    built = results.run(model.mod, TARGET, model.params, Options(level="v3"))
    (idx, _), = built.subprograms
    (stitched,) = built.stitched
    facts, groups = built.group_facts, built.partition.groups
    assert sum(bool(p) for p in facts.local_producers) >= 6      # every step's cell update
    producers = window_prices.producers_of(groups, readers_of(built.program))

    def syncs(f):
        w = window_prices.Window(window_prices.Timer(f, hardware.for_arch("sm_90"), latency.FITTED), producers, idx[0])
        for g in idx:
            w.add(g)
        return w.syncs
    assert syncs(facts) == stitched.grid_syncs
    assert syncs(dataclasses.replace(facts, local_producers=[])) > stitched.grid_syncs


def test_counts_are_kept_on_disk_and_a_cut_entry_is_recounted(tmp_path, monkeypatch):
    """A process that compiles the same group again reads its counts from the cache (the CLI and
    each test worker are processes of their own); an unreadable entry is counted again."""
    import warnings

    monkeypatch.setenv("SOUFFLE_TVM_CACHE", str(tmp_path))
    func = _gemv()
    scheduled = ScheduleCache(TARGET, 512)(func).func
    lowered = lower.lower_stage("g", scheduled, TARGET)
    first = block_counts.counts_of(scheduled, lowered, TARGET, None)
    stitched = block_counts.counts_of(scheduled, lowered, TARGET, 512)
    assert [c.k_steps for c in first] == [8] and [c.k_steps for c in stitched] == [0]

    def never(*_):
        raise AssertionError("counted again")
    counting = executable.device_counts
    monkeypatch.setattr(executable, "device_counts", never)
    assert block_counts.counts_of(scheduled, lowered, TARGET, None) == first
    assert block_counts.counts_of(scheduled, lowered, TARGET, 512) == stitched
    path = block_counts.stored_path(scheduled, TARGET, None)
    path.write_text("[{")
    monkeypatch.setattr(executable, "device_counts", counting)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert block_counts.counts_of(scheduled, lowered, TARGET, None) == first
    assert any("unreadable" in str(w.message) for w in seen)


def test_counts_without_a_writable_cache_are_counted_in_the_process(tmp_path, monkeypatch):
    """A cache folder that cannot be made (a file in its place) costs a count, never the compile."""
    blocked = tmp_path / "cache"
    blocked.write_text("not a folder")
    monkeypatch.setenv("SOUFFLE_TVM_CACHE", str(blocked))
    func = _gemv()
    scheduled = ScheduleCache(TARGET, 512)(func).func
    lowered = lower.lower_stage("g", scheduled, TARGET)
    assert block_counts.stored_path(scheduled, TARGET, None) is None
    assert [c.k_steps for c in block_counts.counts_of(scheduled, lowered, TARGET, None)] == [8]
