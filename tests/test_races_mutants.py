"""The race checker's report (runtime.races) pinned down on small hand-written kernels: which
elements race, between whom, in which phase, how the report counts, caps and prints them, and
how orders are named and drawn. Written against the survivors of a mutation pass
(results/mutation-2026-12-03/): each assertion fails on at least one mutant of races.py that
tests/test_races.py lets through."""

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm.script import tirx as T

from souffle_tvm.core.targets import make_target
from souffle_tvm.runtime import races
from souffle_tvm.runtime.race_probe import ORDER, REPORT

CUDA = make_target("cuda")
RAW, WAR, WAW, ATOM = "read after write", "write after read", "write after write", "plain access and atomic"


def f32(n: int):
    return T.Buffer((n,), "float32")


def f32x(rows: int, cols: int):
    return T.Buffer((rows, cols), "float32")


def i32(n: int):
    return T.Buffer((n,), "int32")


@T.prim_func
def next_block(a: f32(8), out: f32(8)):
    # block b writes its own quarter of a, then reads the other block's: 4 RAW + 4 WAR
    bx = T.launch_thread("blockIdx.x", 2)
    tx = T.launch_thread("threadIdx.x", 4)
    a[bx * 4 + tx] = T.float32(1)
    out[bx * 4 + tx] = a[(bx + 1) % 2 * 4 + tx]


@T.prim_func
def next_block_in_phase_one(a: f32(8), out: f32(8)):
    # the same race, after a grid sync: phase 1
    bx = T.launch_thread("blockIdx.x", 2)
    tx = T.launch_thread("threadIdx.x", 4)
    out[bx * 4 + tx] = T.float32(0)
    T.cuda.grid_sync()
    a[bx * 4 + tx] = T.float32(1)
    out[bx * 4 + tx] = a[(bx + 1) % 2 * 4 + tx]


@T.prim_func
def neighbour(a: f32(8), out: f32(8)):
    # thread t of each block reads what thread t+1 (mod 4) wrote: 8 RAW between threads
    bx = T.launch_thread("blockIdx.x", 2)
    tx = T.launch_thread("threadIdx.x", 4)
    a[bx * 4 + tx] = T.float32(1)
    out[bx * 4 + tx] = a[bx * 4 + (tx + 1) % 4]


@T.prim_func
def atomic_sum_read_early(a: f32(8), out: f32(8)):
    bx = T.launch_thread("blockIdx.x", 2)
    tx = T.launch_thread("threadIdx.x", 4)
    T.cuda.atomic_add(T.address_of(out[0]), a[bx * 4 + tx])
    if tx == 3:
        out[bx * 4 + 1] = out[0]


@T.prim_func
def same_value(a: f32(8), out: f32(2)):
    # every thread of both blocks stores 2 to out[1]: 7 same-value rewrites, no race
    bx = T.launch_thread("blockIdx.x", 2)
    tx = T.launch_thread("threadIdx.x", 4)
    out[bx * 0 + tx * 0 + 1] = T.float32(2)


@T.prim_func
def disjoint(a: f32(8), out: f32(8)):
    bx = T.launch_thread("blockIdx.x", 2)
    tx = T.launch_thread("threadIdx.x", 4)
    out[bx * 4 + tx] = a[bx * 4 + tx] * T.float32(2)


@T.prim_func
def last_block_wins(a: f32(8), out: f32(1)):
    # thread 0 of every block stores the block's index: the last block to run wins
    bx = T.launch_thread("blockIdx.x", 8)
    tx = T.launch_thread("threadIdx.x", 1)
    out[tx] = T.Cast("float32", bx)


@T.prim_func
def mixed_params(x: f32x(2, 3), idx: i32(4), out: f32x(2, 3)):
    bx = T.launch_thread("blockIdx.x", 2)
    tx = T.launch_thread("threadIdx.x", 3)
    out[bx, tx] = x[bx, tx] + T.Cast("float32", idx[tx])


def _run(func, order="ascending", keep=200):
    emu = races.Emulation(tvm.IRModule({"k": func}), CUDA, keep=keep)
    return emu.run(races.arguments(func), order=order)


# -- what a race says: elements, who, phase ----------------------------------------------------
def test_blocks_racing_on_the_next_blocks_elements_ascending():
    _, rep = _run(next_block)
    assert not rep.ok and rep.count == 8 and rep.kernels == ["k"] and rep.order == "ascending"
    # block 0 runs first: it reads a[4:8] before block 1 writes them (WAR) and writes a[0:4]
    # that block 1 then reads (RAW); every race is between block 0 and block 1, in phase 0
    assert sorted((r.kind, r.index) for r in rep.races) == sorted(
        [(WAR, i) for i in range(4, 8)] + [(RAW, i) for i in range(4)])
    assert {(r.kernel, r.level, r.buffer, r.phase, r.first, r.second) for r in rep.races} == {
        ("k", "blocks", "a", 0, 0, 1)}
    assert len(set(rep.races)) == 8          # races are values: hashable, equal by content


def test_blocks_racing_on_the_next_blocks_elements_descending():
    _, rep = _run(next_block, "descending")
    assert rep.count == 8
    assert sorted((r.kind, r.index) for r in rep.races) == sorted(
        [(WAR, i) for i in range(4)] + [(RAW, i) for i in range(4, 8)])
    assert {(r.first, r.second, r.phase) for r in rep.races} == {(1, 0, 0)}


def test_a_race_after_a_grid_sync_is_in_phase_one():
    _, rep = _run(next_block_in_phase_one)
    assert rep.count == 8 and {r.phase for r in rep.races} == {1}
    assert "phase 1" in str(rep.races[0])


def test_threads_racing_within_their_block():
    _, rep = _run(neighbour)
    assert rep.count == 8 and {(r.level, r.kind, r.buffer) for r in rep.races} == {("threads", RAW, "a")}
    # thread t reads a[b*4 + (t+1)%4], written by thread (t+1)%4 of the same block b
    assert sorted((r.block, r.index, r.first, r.second) for r in rep.races) == sorted(
        (b, b * 4 + (t + 1) % 4, (t + 1) % 4, t) for b in range(2) for t in range(4))


def test_several_atomic_updaters_are_named_as_such():
    _, rep = _run(atomic_sum_read_early)
    by_level = {r.level: r for r in rep.races}
    assert set(by_level) == {"blocks", "threads"} and all(r.kind == ATOM and r.index == 0 for r in rep.races)
    assert by_level["threads"].first is None and by_level["threads"].block == 0
    assert (by_level["blocks"].first, by_level["blocks"].second) == (0, 1)
    assert "between threads (block 0) several and 3, phase 0" in str(by_level["threads"])
    assert "between blocks 0 and 1, phase 0" in str(by_level["blocks"])


# -- what the report counts and keeps ------------------------------------------------------------
def test_the_log_is_capped_but_the_count_is_not():
    _, rep = _run(next_block, keep=3)
    assert rep.count == 8 and len(rep.races) == 3 and not rep.ok


def test_the_same_element_is_logged_once_per_kind():
    # two calls of the kernel in one run: the counts add up, the logged elements do not repeat
    emu = races.Emulation(tvm.IRModule({"k": next_block}), CUDA)
    args = races.arguments(next_block)
    with races._Session(races.Order.of("ascending"), emu.probes, emu.keep) as session:
        emu.call(args, None)
        emu.call(args, None)
    rep = session.report
    assert rep.count == 16 and len(rep.races) == 8
    assert len({(r.kind, r.index) for r in rep.races}) == 8


def test_counts_add_up_over_calls_and_kernels_are_named_once():
    emu = races.Emulation(tvm.IRModule({"k": same_value}), CUDA)
    args = races.arguments(same_value)
    with races._Session(races.Order.of("descending"), emu.probes, emu.keep) as session:
        emu.call(args, None)
        emu.call(args, None)
    assert session.report.benign == 14 and session.report.benign_kernels == ["k"] and session.report.ok


def test_runs_do_not_nest():
    emu = races.Emulation(tvm.IRModule({"k": disjoint}), CUDA)
    args = races.arguments(disjoint)
    _, rep = emu.run(args)                    # ascending unless asked
    assert rep.order == "ascending" and rep.ok
    with races._Session(races.Order.of("ascending"), emu.probes, emu.keep):
        with pytest.raises(RuntimeError, match="^race-checked emulations do not nest$"):
            emu.run(args)


def test_same_value_rewrites_are_benign_and_named_by_kernel():
    _, rep = _run(same_value)
    assert rep.ok and rep.count == 0 and rep.benign == 7 and rep.benign_kernels == ["k"]
    assert str(rep) == f"no race in 1 kernel(s), order ascending ({rep.benign} same-value rewrite(s), in k)"


def test_a_clean_kernel_reports_nothing():
    _, rep = _run(disjoint, "descending")
    assert rep.ok and rep.count == 0 and rep.benign == 0 and rep.benign_kernels == [] and rep.races == []
    assert str(rep) == "no race in 1 kernel(s), order descending"


def test_the_report_groups_races_by_kernel_kind_buffer_and_level():
    _, rep = _run(next_block)
    text = str(rep)
    head, *lines = text.split("\n")
    assert head == "8 racy access(es), order ascending:"
    assert sorted(line.strip().split(", e.g.")[0] for line in lines) == [
        f"k: {RAW} on a between blocks, 4 element(s) logged",
        f"k: {WAR} on a between blocks, 4 element(s) logged"]
    assert all(line.startswith("  ") for line in lines)
    # each group's example is the first race of that group in the log
    for line in lines:
        kind = RAW if RAW in line else WAR
        assert line.endswith(", e.g. " + str(next(r for r in rep.races if r.kind == kind)))
    assert rep.kinds() == {("blocks", RAW, "a"), ("blocks", WAR, "a")}


def test_race_and_report_text():
    r = races.Race("k", "blocks", RAW, "a", 5, 2, 0, 3, 0)
    assert str(r) == f"k: {RAW} on a[5] between blocks 0 and 3, phase 2"
    r = races.Race("k", "threads", ATOM, "s", 1, 0, None, 7, 4)
    assert str(r) == f"k: {ATOM} on s[1] between threads (block 4) several and 7, phase 0"
    rep = races.RaceReport("shuffle:1", ["k", "m"])
    assert rep.ok and str(rep) == "no race in 2 kernel(s), order shuffle:1"
    rep.benign, rep.benign_kernels = 3, ["k", "m"]
    assert str(rep) == "no race in 2 kernel(s), order shuffle:1 (3 same-value rewrite(s), in k, m)"


# -- orders ----------------------------------------------------------------------------------------
def test_orders_by_name_digits_and_seed():
    assert races.Order.of("ascending") == races.Order() == races.Order("ascending", "ascending")
    assert races.Order.of("descending") == races.Order("descending", "descending")
    assert races.Order.of("12") == races.Order(12, 12)
    assert races.Order.of("shuffle") == races.Order(0, 0) == races.Order.of("shuffle:")
    o = races.Order(blocks="descending", threads=4)
    assert races.Order.of(o) is o
    for bad in ("backwards", "random", 1.5, None):
        with pytest.raises(ValueError) as e:
            races.Order.of(bad)
        assert str(e.value) == f"order {bad!r}: ascending, descending, shuffle:SEED or a seed"


def test_order_names():
    assert str(races.Order()) == "ascending"
    assert str(races.Order.of("descending")) == "descending"
    assert str(races.Order.of("shuffle:9")) == "shuffle:9"
    assert str(races.Order("ascending", "descending")) == "blocks ascending, threads descending"
    assert str(races.Order(3, "ascending")) == "blocks shuffle:3, threads ascending"
    assert str(races.Order("descending", 0)) == "blocks descending, threads shuffle:0"
    with pytest.raises(Exception):
        races.Order().blocks = "descending"      # frozen: an Order names one run's order


def test_blocks_run_in_the_order_asked():
    emu = races.Emulation(tvm.IRModule({"k": last_block_wins}), CUDA)
    args = races.arguments(last_block_wins)

    def last(order):
        outs, rep = emu.run(args, order=order)
        assert rep.kinds() == {("blocks", WAW, "out")}
        return int(outs[1][0])

    assert last("ascending") == 7 and last("descending") == 0
    assert last(races.Order("descending", "ascending")) == 0
    for seed in (1, 2, 3, 4):
        # a shuffle is seeded: the same seed runs the same order, the first table drawn being
        # the blocks' of the one phase
        expected = int(np.random.default_rng(seed).permutation(8)[-1])
        assert last(seed) == expected == last(f"shuffle:{seed}")


def test_shuffles_draw_a_new_permutation_for_each_table():
    s = races._Session(races.Order(blocks=5, threads="descending"), {}, 10)
    rng = np.random.default_rng(5)
    for n in (8, 8, 3):
        p = s.permutation("blocks", n)
        assert p.dtype == np.int64 and list(p) == list(rng.permutation(n))
    assert list(s.permutation("threads", 4)) == [3, 2, 1, 0]
    t = races._Session(races.Order(blocks="ascending", threads=6), {}, 10)
    assert list(t.permutation("blocks", 5)) == [0, 1, 2, 3, 4]
    assert list(t.permutation("threads", 6)) == list(np.random.default_rng(6).permutation(6))


def test_order_tables_are_filled_only_inside_a_run():
    fill = tvm_ffi.get_global_func(ORDER)
    with pytest.raises(Exception, match="^a race-checked kernel ran outside Emulation.run$"):
        fill("blocks", tvm.runtime.tensor(np.zeros(4, "int64")))
    # a report outside a run is dropped, not an error
    report = tvm_ffi.get_global_func(REPORT)
    report("k", tvm.runtime.tensor(np.zeros(3, "int64")), tvm.runtime.tensor(np.zeros((2, 1, 5), "int64")))


# -- arguments and check -------------------------------------------------------------------------
def test_arguments_draw_floats_and_zero_integers():
    args = races.arguments(mixed_params, seed=3)
    assert [(a.shape, str(a.dtype)) for a in args] == [((2, 3), "float32"), ((4,), "int32"), ((2, 3), "float32")]
    assert not np.any(args[1]) and np.all(args[0] != 0) and np.all(args[2] != 0)
    rng = np.random.default_rng(3)
    np.testing.assert_array_equal(args[0], rng.standard_normal((2, 3)).astype("float32"))
    np.testing.assert_array_equal(races.arguments(mixed_params, seed=3)[0], args[0])
    assert not np.array_equal(races.arguments(mixed_params)[0], args[0])


def test_check_runs_a_lone_kernel_in_the_order_asked():
    rep = races.check(next_block, CUDA, "descending")
    assert rep.order == "descending" and rep.count == 8 and {(r.first, r.second) for r in rep.races} == {(1, 0)}
    # a lone PrimFunc is reported as "kernel"
    assert rep.kernels == ["kernel"] and {r.kernel for r in rep.races} == {"kernel"}
    assert str(rep).split("\n")[1].startswith("  kernel: ")
    rep = races.check(tvm.IRModule({"k": disjoint}), CUDA)
    assert rep.ok and rep.order == "ascending" and rep.kernels == ["k"]


def test_check_uses_the_inputs_it_is_given():
    # the same-value rewrite is counted only when the values written agree: with out[1] = x it
    # depends on nothing; here the kernel writes a[0] into out[0] from both blocks
    @T.prim_func
    def copy_first(a: f32(4), out: f32(1)):
        bx = T.launch_thread("blockIdx.x", 2)
        tx = T.launch_thread("threadIdx.x", 1)
        out[tx] = a[bx]

    same = races.check(copy_first, CUDA, inputs=[np.ones(4, "float32"), np.zeros(1, "float32")])
    assert same.ok and same.benign == 1
    differ = races.check(copy_first, CUDA, inputs=[np.arange(4, dtype="float32"), np.zeros(1, "float32")])
    assert not differ.ok and differ.kinds() == {("blocks", WAW, "out")}


def test_check_refuses_a_module_of_two_kernels_without_inputs():
    with pytest.raises(ValueError, match="^a module with a Relax main needs its inputs$"):
        races.check(tvm.IRModule({"k": disjoint, "m": neighbour}), CUDA)
