"""Resident inputs (stitch.resident): a weight several stitched stages read the same box of per
block is copied into each block's shared memory once, by the first reader, and read there after
(an LSTM layer's recurrent weights across its time steps). Checked by the static check, the race
checker in three block orders with the copy poisoned with NaN until filled, and numerics against
numpy or onnxruntime; the report's bytes against the emulator's count."""

import math

import numpy as np
import onnx
import pytest
import tvm
import tvm_ffi
from tvm import tirx
from tvm.script import tirx as T

from conftest import race_checked_in_orders
from test_traffic import _held, _souffle_report
from souffle_tvm.core.targets import make_target
from souffle_tvm.frontend.importer import import_onnx
from souffle_tvm.pipeline import results as pipeline
from souffle_tvm.pipeline.options import Options
from souffle_tvm.runtime import races
from souffle_tvm.stitch import check as stitch_check, kernel, lower, resident
from souffle_tvm.zoo import lstm as lstm_zoo

CUDA = make_target("cuda")
ORDERS = ("ascending", "descending", "shuffle:3")


@T.prim_func
def gemv(a: T.Buffer((T.int64(512),), "float32"), w: T.Buffer((T.int64(64), T.int64(512)), "float32"),
         b: T.Buffer((T.int64(512),), "float32")):
    # b = a[:64] @ w: block bx makes 64 outputs, reading columns [64 bx, 64 bx + 64) of w
    bx = T.launch_thread("blockIdx.x", T.int64(8))
    tx = T.launch_thread("threadIdx.x", T.int64(64))
    b[bx * 64 + tx] = T.float32(0)
    for k in range(T.int64(64)):
        b[bx * 64 + tx] = b[bx * 64 + tx] + a[k] * w[k, bx * 64 + tx]


def _stitched(grid: int, private=lambda k: False, products: int = 3) -> kernel.Stitched:
    """Products by the same weight, each reading the one before's result (a grid sync apart)."""
    names = ["x"] + [f"y{i}" for i in range(products)]
    stages = [st for i in range(products) for st in lower.lower_stage(f"p{i}", gemv, CUDA)]
    return kernel.stitch(stages, [[a, "w", b] for a, b in zip(names, names[1:])], grid, 64,
                         param_keys=["x", "w"] + names[1:], private=private)


def _run(func, order="ascending"):
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal(512).astype("float32"), rng.standard_normal((64, 512)).astype("float32")
    args = [x, w] + [np.zeros(512, "float32") for _ in func.params[2:]]
    outs, report = races.Emulation(tvm.IRModule({"k": func}), CUDA).run(args, order=order)
    want = x.astype("float64")
    for _ in func.params[2:]:
        want = want[:64] @ w.astype("float64")
    return want, outs[-1], report


def _close(z, want) -> bool:
    return bool(np.linalg.norm(z - want) <= 1e-5 * np.linalg.norm(want))


def _global_loads(func, name: str) -> int:
    found = []
    tvm_ffi.structural_walk(func.body, (tvm.ir.TensorLoad, lambda x: found.append(x) if x.source.name == name else None))
    return len(found)


def test_a_weight_three_stages_read_is_copied_on_chip_once():
    st = _stitched(8)
    [res] = st.residents
    assert res.name == "w" and res.readers == [0, 1, 2] and [e for _, e in res.box] == [64, 64]
    assert res.bytes == 64 * 64 * 4 and res.filled_bytes == 64 * 512 * 4 and str(res.buffer.ty.storage_scope) == "shared"
    # the later products no longer read w: one load of it is left, the first reader's fill
    assert _global_loads(st.func, "w") == 1
    assert stitch_check.check(st.func, 8, None).ok
    for order in ORDERS:
        want, z, report = _run(st.func, order)
        assert report.ok, (order, str(report))
        assert _close(z, want), order


def test_no_copy_where_a_block_runs_two_virtual_blocks():
    """On 4 blocks, block 0 runs virtual blocks 0 and 4: no one box of w is its own."""
    st = _stitched(4)
    assert st.residents == [] and _global_loads(st.func, "w") == 3
    want, z, report = _run(st.func)
    assert report.ok and _close(z, want)


def test_no_copy_without_the_on_chip_channel_the_rereads_or_the_shared_memory(monkeypatch):
    assert _stitched(8, private=None).residents == []
    assert _stitched(8, products=2).residents == []       # one read spared: the channels get the room
    monkeypatch.setattr(resident, "STATIC_SHARED_LIMIT", 8 * 1024)      # the 16 KB copy no longer fits
    assert _stitched(8).residents == []


def test_a_copy_read_before_it_is_filled_reads_poison():
    """The fill's store removed: the later products read the NaN the emulator fills shared
    buffers with, never a stale or zero value."""
    st = _stitched(8)
    [res] = st.residents
    gone = tvm_ffi.structural_map(st.func.body, (tirx.BufferStore, lambda s: tirx.Evaluate(tirx.const(0, "int32"))
                                                 if s.buffer.same_as(res.buffer) else s))
    _, z, _ = _run(tirx.PrimFunc(st.func.params, gone, attrs=st.func.attrs))
    assert np.isnan(z).all()


@pytest.fixture(scope="module")
def lstm(tmp_path_factory):
    """The small LSTM at batch 1, as the full one runs: its recurrent product a matrix-vector
    product (``ColumnReduction``), each block reading whole columns of R. (At the small zoo's
    batch 2 the product is a GEMM tile whose guard the read box cannot see: not copied.)"""
    path = tmp_path_factory.mktemp("lstm") / "lstm_b1.onnx"
    onnx.save(lstm_zoo.build(lstm_zoo.LSTMConfig(layers=2, steps=8, hidden=16, features=16, batch=1)), str(path))
    m = import_onnx(str(path))
    return m, pipeline.run(m.mod, CUDA, m.params, Options(level="v3"))


def test_each_lstm_layer_keeps_its_recurrent_weights_on_chip(lstm):
    """Every layer's recurrent product reads R from the block's copy after the layer's first
    step; both layers' copies share one buffer (a grid sync apart). Race-checked in three block
    orders against onnxruntime."""
    m, souffle = lstm
    [sk] = souffle.stitched
    assert len(sk.resident_inputs) == 2, sk.resident_inputs       # each layer's R (the biases are read once a block)
    copies = [b for b in _shared_names(souffle.mod[sk.function]) if b.endswith("_resident")]
    assert len(copies) == len(set(copies)) and len(copies) < len(sk.resident_inputs)
    # per stage the positions read on chip: every recurrent product after each layer's first
    products = [i for i, s in enumerate(sk.stages) if s == sk.stages[_first_product(sk)]]
    func = souffle.unstitched[sk.stages[products[0]]]
    r_at = max(range(len(func.params)), key=lambda j: math.prod(int(d) for d in func.params[j].ty.shape))
    # each layer's first fills the copy (its gates, its output, stay on chip in every product)
    assert [r_at in sk.onchip[i] for i in products].count(False) == 2
    for order, report, comparisons in race_checked_in_orders(m, souffle, ORDERS):
        assert report.ok, str(report)
        for cmp in comparisons:
            assert cmp.finite and cmp.rel_l2 < 1e-5, (order, cmp)


@pytest.mark.slow
def test_the_report_charges_the_copy_once_as_the_emulator_counts(lstm):
    """A product reading the copy is charged no R (16 x 64 fp32), each layer's first its fill;
    every stage's analytic bytes equal what its stage loops touch in the emulator."""
    m, souffle = lstm
    [sk] = souffle.stitched
    products = [i for i, s in enumerate(sk.stages) if s == sk.stages[_first_product(sk)]]
    result, report = _souffle_report(m, souffle)
    [kr] = [k for k in report.kernels if k.stages]
    r_bytes = 16 * 64 * 4
    charged = [kr.stage_plan[i]["bytes"] for i in products]
    assert sum(b >= r_bytes for b in charged) == 2 and max(b for b in charged if b < r_bytes) < r_bytes // 4
    assert [h for h in _held(m, souffle.mod, souffle.params, report, result, souffle.stitched) if not h.equal] == []


def _shared_names(func) -> list[str]:
    found = []
    tvm_ffi.structural_walk(func.body, (tirx.AllocBuffer, lambda x: found.append(str(x.buffer.name))
                                        if str(x.buffer.ty.storage_scope) == "shared" else None))
    return found


def _first_product(sk) -> int:
    """The first stage of the function most stages call: the recurrent product."""
    counts = {s: sk.stages.count(s) for s in sk.stages}
    return sk.stages.index(max(counts, key=counts.get))


def test_the_time_partitioner_credits_a_later_reader_its_copy(lstm):
    """A later recurrent product, in a window with its layer's first, reads R (16 x 64 fp32) on
    chip: its credit names that first reader and R's footprint."""
    m, _ = lstm
    souffle = pipeline.run(m.mod, CUDA, m.params, Options(level="auto"))
    groups, credits = souffle.partition.groups, souffle.group_facts.onchip
    products = [i for i, g in enumerate(groups) if credits[i] is not None and credits[i][1] == 16 * 64 * 4]
    assert len(products) >= 2 * 5, [(g.name, c) for g, c in zip(groups, credits)]
    firsts = {credits[i][0] for i in products}
    assert len(firsts) == 2 and all(credits[i][0] < i for i in products)      # one first reader a layer
