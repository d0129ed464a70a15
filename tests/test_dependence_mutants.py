"""The barrier proof (stitch.dependence) on hand-built stage bodies in vb form: which barrier a
reader needs after a writer (none, a block barrier, a grid sync), and the per-block box the
on-chip channel is sized by. Each case is small enough to check by hand; together they fail on
the mutants of dependence.py that the pipeline-level tests let through (results/mutation-2026-12-03/).

Convention below: 8 virtual blocks of 64 threads; the writer's block ``vb`` owns elements
``[64 vb, 64 vb + 64)`` of a 512-element buffer ``b``."""

import pytest
import tvm
import tvm.sym
import tvm_ffi
from tvm import tirx

from souffle_tvm.stitch import dependence as d
from souffle_tvm.stitch.dependence import BLOCK, GRID, NONE, VB

I64 = "int64"
F32 = "float32"


def c(v: int):
    return tirx.const(v, I64)


def one():
    return tirx.const(1.0, F32)


TID = tirx.Var("tid", I64)
B = tirx.decl_buffer((c(1024),), F32, "b")
OUT = tirx.decl_buffer((c(1024),), F32, "out")
OWN = VB * c(64) + TID                 # thread tid of block vb's own element


def view(body, blocks: int = 8, threads: int = 64) -> d.StageView:
    return d.StageView(body, TID, blocks, threads)


def store(idx, value=None, buf=B):
    return tirx.BufferStore(buf, one() if value is None else value, [idx])


def reads(idx, buf=B):
    """A reader stage: ``out[own] = b[idx]``."""
    return store(OWN, buf[idx], OUT)


def loop(var, extent: int, body):
    return tirx.For(var, c(0), c(extent), tirx.ForKind.SERIAL, body)


def atomic_add(idx, value=None, buf=B):
    return tirx.Evaluate(tirx.call_intrin(F32, "tirx.cuda.atomic_add",
                                          tirx.call_intrin("handle", "tirx.address_of", buf[idx]),
                                          one() if value is None else value))


WRITER = view(store(OWN))


def need(reader_body, writer=WRITER, blocks: int = 8, threads: int = 64) -> str:
    return d.barrier_needed(writer, B, view(reader_body, blocks, threads), B)


# -- the order of barriers ---------------------------------------------------------------------
def test_stronger_picks_the_stronger_barrier_either_way_round():
    order = [NONE, BLOCK, GRID]
    for i, a in enumerate(order):
        for j, b in enumerate(order):
            assert d.stronger(a, b) == order[max(i, j)], (a, b)
    assert len({NONE, BLOCK, GRID}) == 3


# -- barrier_needed: the three answers ---------------------------------------------------------
def test_a_reader_of_its_own_threads_elements_needs_no_barrier():
    assert need(reads(OWN)) == NONE


def test_a_reader_of_other_threads_of_its_block_needs_a_block_barrier():
    assert need(reads(VB * c(64) + c(63) - TID)) == BLOCK        # the whole box, edge to edge


def test_a_reader_of_the_next_block_needs_a_grid_sync():
    assert need(reads((VB + c(1)) % c(8) * c(64) + TID)) == GRID


def test_a_reader_that_does_not_read_the_buffer_needs_nothing():
    assert need(store(OWN, OUT[c(1023) - OWN], OUT)) == NONE


@pytest.mark.parametrize("offset,expected", [(-1, GRID), (1, GRID), (0, BLOCK)])
def test_one_element_outside_the_box_needs_a_grid_sync(offset, expected):
    # thread tid reads b[64 vb + tid + offset]: offset -1 reaches the previous block's last
    # element (tid 0), +1 the next block's first (tid 63)
    assert need(reads(VB * c(64) + ((TID + c(offset)) if offset else (c(63) - TID)))) == expected


def test_a_read_below_block_one_is_seen_from_block_zero():
    # b[64 max(vb, 1) + tid]: block 0 reads block 1's elements
    assert need(reads(tirx.Max(VB, c(1)) * c(64) + TID)) == GRID


def test_more_reader_blocks_than_writer_blocks_need_a_grid_sync():
    assert need(reads(OWN), blocks=9) == GRID
    assert need(reads(OWN), blocks=7) == NONE


def test_a_reader_with_more_threads_than_the_writer():
    # threads 64..127 of the reader read elements no writer thread of the block wrote
    assert need(reads(OWN), threads=128) == GRID
    # with as many or fewer threads, thread-local stays thread-local
    assert need(reads(OWN), threads=64) == NONE
    assert need(reads(OWN), threads=32) == NONE


def test_thread_locality_uses_the_thread_range():
    # b[64 vb + tid % 64] is thread tid's own element only because tid < 64
    assert need(reads(VB * c(64) + tirx.FloorMod(TID, c(64)))) == NONE


def test_the_reader_loop_range_is_inclusive_of_its_last_iteration():
    j = tirx.Var("j", I64)
    fits = loop(j, 64, reads(VB * c(64) + j))          # j in [0, 64): the whole box
    assert need(fits) == BLOCK
    over = loop(j, 65, reads(VB * c(64) + j))          # j = 64 is the next block's
    assert need(over) == GRID


def test_a_writer_loop_makes_a_wider_box():
    i, j = tirx.Var("i", I64), tirx.Var("j", I64)
    writer = view(loop(i, 4, store(VB * c(256) + i * c(64) + TID)))   # block vb owns [256 vb, 256 vb + 256)
    assert need(loop(j, 256, reads(VB * c(256) + j)), writer, blocks=4) == BLOCK
    assert need(loop(j, 257, reads(VB * c(256) + j)), writer, blocks=4) == GRID
    assert need(reads(VB * c(256) + c(3) * c(64) + TID), writer, blocks=4) == BLOCK


# -- what the writer's store must look like ----------------------------------------------------
def test_a_store_under_a_condition_proves_nothing():
    guarded = view(tirx.IfThenElse(TID < c(64), store(OWN), None))
    assert need(reads(OWN), guarded) == GRID
    in_else = view(tirx.IfThenElse(TID >= c(64), store(OWN, buf=OUT), store(OWN)))
    assert need(reads(OWN), in_else) == GRID


def test_a_store_in_a_construct_the_walk_does_not_model_proves_nothing():
    writer = view(tirx.While(TID < c(64), store(OWN)))      # a while loop: its stores prove nothing
    assert need(reads(OWN), writer) == GRID


def test_a_strided_store_writes_no_dense_box():
    # block vb writes the even elements of [128 vb, 128 vb + 128): the odd ones are not its own
    writer = view(store(VB * c(128) + TID * c(2)))
    assert need(reads(VB * c(128) + c(1)), writer) == GRID
    assert need(reads(VB * c(128) + TID * c(2)), writer) == NONE


def test_one_element_per_block():
    writer = view(store(VB * c(2)))       # every thread of block vb writes b[2 vb]
    assert need(reads(VB * c(2)), writer) == NONE
    assert need(reads(VB * c(2) + c(1)), writer) == GRID


def test_a_loop_of_unknown_extent_proves_nothing():
    i, n = tirx.Var("i", I64), tirx.Var("n", I64)
    writer = view(tirx.For(i, c(0), n, tirx.ForKind.SERIAL, store(VB * c(64) + TID)))
    assert need(reads(OWN), writer) == GRID


def test_an_index_narrowed_to_32_bits_and_back_is_seen_through():
    narrowed = tirx.Cast(I64, tirx.Cast("int32", VB))
    writer = view(store(narrowed * c(64) + TID))
    assert need(reads(OWN), writer) == NONE
    assert need(reads(VB * c(64) + c(63) - TID), writer) == BLOCK
    # a lone widening cast (int32 arithmetic) is left alone: the next block's reader still
    # needs its grid sync
    vb32, tid32 = tirx.Cast("int32", VB), tirx.Cast("int32", TID)
    writer32 = view(store(tirx.Cast(I64, vb32 * tirx.const(64, "int32") + tid32)))
    assert need(reads((VB + c(1)) % c(8) * c(64) + TID), writer32) == GRID


def test_int32_indices_are_widened():
    own32 = tirx.Cast("int32", VB) * tirx.const(64, "int32") + tirx.Cast("int32", TID)
    writer = view(store(own32))
    assert need(reads(own32), writer) == NONE
    assert need(reads((VB + c(1)) % c(8) * c(64) + TID), writer) == GRID


def test_int32_arithmetic_under_casts_is_seen_through():
    # what lowering leaves in a GEMM stage's store: int32(tid % 64) // 8 * 8 + int32(tid % 64) % 8,
    # the iterator analysis cannot take a cast apart (ResNeXt's 1x1 convolutions got a grid sync)
    t32 = tirx.Cast("int32", tirx.FloorMod(TID, c(64)))
    split = tirx.FloorDiv(t32, tirx.const(8, "int32")) * tirx.const(8, "int32") + tirx.FloorMod(t32, tirx.const(8, "int32"))
    writer = view(store(VB * c(64) + tirx.Cast(I64, split)))
    assert need(reads(VB * c(64) + c(63) - TID), writer) == BLOCK
    assert need(reads(OWN), writer) == NONE
    assert need(reads(VB * c(64) + TID + c(1)), writer) == GRID


def test_int32_loop_variables_are_widened():
    i, j = tirx.Var("i", "int32"), tirx.Var("j", "int32")
    wide = lambda v: tirx.Cast(I64, v)
    writer = view(tirx.For(i, tirx.const(0, "int32"), tirx.const(4, "int32"), tirx.ForKind.SERIAL,
                           store(VB * c(256) + wide(i) * c(64) + TID)))
    whole = tirx.For(j, tirx.const(0, "int32"), tirx.const(256, "int32"), tirx.ForKind.SERIAL, reads(VB * c(256) + wide(j)))
    assert need(whole, writer, blocks=4) == BLOCK
    past = tirx.For(j, tirx.const(0, "int32"), tirx.const(257, "int32"), tirx.ForKind.SERIAL, reads(VB * c(256) + wide(j)))
    assert need(past, writer, blocks=4) == GRID


def test_a_loop_variable_left_unwidened_proves_nothing():
    # found in review: under a truncating mod the int32 loop variable is not renamed, so it was
    # a free symbol beside its widened self, and the proof said NONE where a grid sync is needed.
    # Block vb writes the even elements of its 64 (j + j % 2) and the odd ones of block vb - 1's;
    # the reader's b[64 vb + 1] is block vb + 1's
    j, k = tirx.Var("j", "int32"), tirx.Var("k", I64)
    i32 = lambda v: tirx.const(v, "int32")     # noqa: E731
    own = VB * c(64) + tirx.Cast(I64, j + tirx.Mod(j, i32(2)))
    prev = tirx.FloorMod(VB + c(7), c(8)) * c(64) + k * c(2) + c(1)
    writer = view(tirx.SeqStmt([tirx.For(j, i32(0), i32(63), tirx.ForKind.SERIAL, store(own)),
                                tirx.For(k, c(0), c(32), tirx.ForKind.SERIAL, store(prev))]))
    assert need(reads(VB * c(64) + c(1) + tirx.FloorMod(TID, c(61))), writer) == GRID


def test_a_cast_that_changes_the_value_is_not_dropped():
    # int8(4 tid) wraps for tid >= 32: the store writes no dense box of its block
    wraps = view(store(VB * c(64) + tirx.Cast(I64, tirx.Cast("int8", TID * c(4))) // c(4)))
    assert need(reads(VB * c(64) + c(63) - TID), wraps) == GRID


def test_one_virtual_block_each_needs_a_block_barrier_whatever_the_stores():
    guarded = view(tirx.IfThenElse(TID < c(8), store(TID * c(3)), None), blocks=1)
    assert need(reads(c(1023) - TID), guarded, blocks=1) == BLOCK
    assert need(reads(c(1023) - TID), guarded, blocks=2) == GRID     # block 1 has no writer
    wide = view(tirx.IfThenElse(TID < c(8), store(TID * c(3)), None), blocks=2)
    assert need(reads(c(1023) - TID), wide, blocks=1) == GRID        # block 1 wrote some of it
    # the channel of a one-block writer holds the whole buffer, corner 0, where every stage spans
    # the kernel's 64 threads and touches it under an ``if`` in one statement at most (TVM's
    # ThreadSync cannot put a barrier under an ``if``: two statements, or one in a loop, might need one)
    plain = view(store(TID * c(3)), blocks=1)
    reader = (view(reads(c(1023) - TID), blocks=1), B)
    for writer in (plain, guarded):
        box = d.covering_box(writer, B, [reader], block=64)
        assert [(int(base), int(ext)) for base, ext in box] == [(0, 1024)]
    assert d.covering_box(plain, B, [reader], block=128) is None
    j = tirx.Var("j", I64)
    twice = view(tirx.IfThenElse(TID < c(8), tirx.SeqStmt([store(TID * c(3)), store(TID * c(3) + c(1))]), None),
                 blocks=1)
    looped = view(tirx.IfThenElse(TID < c(8), tirx.For(j, c(0), c(3), tirx.ForKind.SERIAL, store(TID * c(3) + j)),
                                  None), blocks=1)
    for writer in (twice, looped):
        assert d.covering_box(writer, B, [reader], block=64) is None
    other = tirx.SeqStmt([store(TID * c(3)), store(TID, one(), OUT)])      # one statement on B, one on OUT
    assert d.covering_box(view(tirx.IfThenElse(TID < c(8), other, None), blocks=1), B, [reader], block=64)


def test_atomic_updates_prove_no_ownership():
    writer = view(atomic_add(OWN))
    assert need(reads(OWN), writer) == GRID
    # a plain store beside them still proves the block's box
    both = view(tirx.SeqStmt([store(OWN), atomic_add(OWN)]))
    assert need(reads(VB * c(64) + c(63) - TID), both) == BLOCK


# -- where the reader's loads are found --------------------------------------------------------
def test_loads_are_found_wherever_the_reader_evaluates_them():
    j = tirx.Var("j", I64)
    mirror = B[VB * c(64) + c(63) - TID]
    as_int = tirx.Cast(I64, mirror)
    cases = {
        "if condition": tirx.IfThenElse(mirror > one(), store(OWN, one(), OUT), None),
        "then branch": tirx.IfThenElse(TID < c(64), store(OWN, mirror, OUT), None),
        "else branch": tirx.IfThenElse(TID >= c(64), store(OWN, one(), OUT), store(OWN, mirror, OUT)),
        "loop extent": tirx.For(j, c(0), as_int, tirx.ForKind.SERIAL, store(OWN, one(), OUT)),
        "loop min": tirx.For(j, as_int, c(1), tirx.ForKind.SERIAL, store(OWN, one(), OUT)),
        "attr value": tirx.AttrStmt(OUT.data, "pragma_x", as_int, store(OWN, one(), OUT)),
        "store index": store(tirx.Cast(I64, mirror) % c(1024), one(), OUT),
        "evaluate": tirx.Evaluate(mirror),
        "while body": tirx.While(TID < c(64), store(OWN, mirror, OUT)),
        "bind value": tirx.SeqStmt([tirx.Bind(tirx.Var("x", F32), mirror), store(OWN, one(), OUT)]),
    }
    for where, body in cases.items():
        assert need(body) == BLOCK, where


def test_an_if_without_an_else_is_fine():
    assert need(tirx.IfThenElse(TID < c(64), reads(OWN), None)) == NONE


# -- covering_box: the per-block buffer of the on-chip channel ---------------------------------
def _box(writer_body, *reader_bodies):
    return d.covering_box(view(writer_body), B, [(view(r), B) for r in reader_bodies])


def _same(box, expected) -> bool:
    return len(box) == len(expected) and all(
        tvm_ffi.structural_equal(tvm.sym.Analyzer().simplify(base - eb), c(0)) and int(ext) == ee
        for (base, ext), (eb, ee) in zip(box, expected))


def test_the_covering_box_is_the_writers_block():
    box = _box(store(OWN), reads(VB * c(64) + c(63) - TID))
    assert _same(box, [(VB * c(64), 64)])
    assert _same(_box(store(OWN)), [(VB * c(64), 64)])


def test_no_covering_box_for_a_reader_outside_it():
    assert _box(store(OWN), reads((VB + c(1)) % c(8) * c(64) + TID)) is None
    assert _box(store(OWN), reads(VB * c(64) + TID + c(1))) is None


def test_the_writers_own_loads_must_fit_too():
    # a reduction's update reads what its init wrote; here the writer also reads the next block's
    writer = tirx.SeqStmt([store(OWN), store(OWN, B[(VB + c(1)) % c(8) * c(64) + TID])])
    assert _box(writer, reads(OWN)) is None
    inside = tirx.SeqStmt([store(OWN), store(OWN, B[VB * c(64) + c(63) - TID] + one())])
    assert _same(_box(inside, reads(OWN)), [(VB * c(64), 64)])


def test_every_reader_must_fit():
    ok, bad = reads(OWN), reads((VB + c(1)) % c(8) * c(64) + TID)
    assert _box(store(OWN), ok, bad) is None and _box(store(OWN), bad, ok) is None
    assert _same(_box(store(OWN), ok, ok), [(VB * c(64), 64)])


def test_no_covering_box_without_a_store():
    assert _box(store(OWN, buf=OUT), reads(OWN)) is None


def test_no_covering_box_with_atomics():
    assert _box(tirx.SeqStmt([store(OWN), atomic_add(OWN)]), reads(OWN)) is None


def test_no_covering_box_with_vector_accesses():
    ramp = tirx.Ramp(VB * c(64) + TID * c(4), c(1), 4)
    vec_reader = tirx.BufferStore(tirx.decl_buffer((c(4096),), "float32x4", "o4"), B[ramp], [OWN])
    assert _box(store(OWN), vec_reader) is None


def test_a_guarded_store_is_passed_over_for_one_that_proves_the_box():
    guarded = tirx.IfThenElse(TID < c(32), store(OWN), None)
    assert _same(_box(tirx.SeqStmt([guarded, store(OWN)]), reads(OWN)), [(VB * c(64), 64)])
    # the store in the while loop is an access of the writer too, and it leaves the box
    far = tirx.While(TID < c(64), store((VB + c(1)) % c(8) * c(64) + TID))
    assert _box(tirx.SeqStmt([store(OWN), far]), reads(OWN)) is None


def test_a_box_of_unknown_extent_is_not_a_covering_box():
    i, n = tirx.Var("i", I64), tirx.Var("n", I64)
    unknown = tirx.For(i, c(0), n, tirx.ForKind.SERIAL, store(VB * c(64) + TID))
    assert _box(unknown, reads(OWN)) is None


# -- atomics and block barriers -----------------------------------------------------------------
def test_atomic_targets_are_the_buffers_added_to():
    assert [x.same_as(B) for x in d.atomic_targets(atomic_add(OWN))] == [True]
    two = tirx.SeqStmt([atomic_add(OWN), atomic_add(OWN, buf=OUT), store(OWN)])
    assert [x.name for x in d.atomic_targets(two)] == ["b", "out"]
    assert d.atomic_targets(store(OWN)) == []
    # an address that is not &buf[...] names no buffer
    opaque = tirx.Evaluate(tirx.call_intrin(F32, "tirx.cuda.atomic_add", B.data, one()))
    assert d.atomic_targets(opaque) == []
    cast = tirx.call_intrin("handle", "tirx.reinterpret", B[OWN])       # not &b[...]
    assert d.atomic_targets(tirx.Evaluate(tirx.call_intrin(F32, "tirx.cuda.atomic_add", cast, one()))) == []


def test_block_barrier_is_syncthreads():
    bar = d.block_barrier()
    assert d.is_block_barrier(bar)
    assert bar.value.op.name == "tirx.tvm_storage_sync" and str(bar.value.args[0].value) == "shared"
    assert str(bar.value.ty.dtype) == "int32"
    assert not d.is_block_barrier(tirx.Evaluate(c(0)))
    assert not d.is_block_barrier(store(OWN))
    assert not d.is_block_barrier(tirx.Evaluate(tirx.call_intrin("int32", "tirx.cuda.grid_sync")))


def test_a_load_that_cannot_be_bounded_is_never_inside_the_box():
    """A reader whose index keeps an int32 loop variable under a truncating division (which the
    int64 widening does not rebuild) cannot be bounded: it is not proved inside the writer's
    box, so no channel is sized by it (mutant #90 of results/mutation-2026-12-08 answered inside)."""
    i = tirx.Var("i", "int32")
    hidden = tirx.Cast(I64, tirx.Div(i, tirx.const(2, "int32")))
    assert _box(store(OWN), loop(i, 1, reads(VB * c(64) + TID + hidden))) is None
    assert _same(_box(store(OWN), loop(i, 1, reads(OWN))), [(VB * c(64), 64)])      # the same, bounded
