"""Static floors on GPU time (cost/floors.py), the block counts they read from lowered TIR
(cost/tir_counts.py), and the latency model held above them."""

import dataclasses
import json
import math
import re

import pytest
from tvm.script import tirx as T

from conftest import assert_floors_hold, needs_nvcc
from souffle_tvm.codegen import schedule
from souffle_tvm.cost import floors, hardware, latency, measured, tir_counts
from souffle_tvm.pipeline.driver import compile as compile_model
from souffle_tvm.cost.work import BlockCounts, Stage, BARRIER_CYCLES

H200 = hardware.for_arch("sm_90")


def f32_ptr():
    """A global float32 pointer parameter (a call, not a string annotation pyflakes would read)."""
    return T.handle("float32", "global")


@T.prim_func(s_tir=True)
def _k_loop(a_ptr: f32_ptr(), c_ptr: f32_ptr()):
    T.func_attr({"tirx.is_global_func": True, "tirx.noalias": True})
    a = T.decl_buffer((4096,), data=a_ptr)
    c = T.decl_buffer((64,), data=c_ptr)
    with T.launch_thread("blockIdx.x", 4) as bx:
        acc = T.alloc_local((1,))
        tile = T.alloc_shared((64,))
        tx = T.launch_thread("threadIdx.x", 64)
        acc[0] = T.float32(0.0)
        for ko in range(8):
            tile[tx] = a[bx * 1024 + ko * 64 + tx]
            T.tvm_storage_sync("shared")
            acc[0] = acc[0] + tile[tx] * tile[63 - tx]
            T.tvm_storage_sync("shared")
        if tx < 32:
            tile[tx] = acc[0]
        c[tx] = acc[0]


def test_a_k_loop_is_counted_by_hand():
    """Two warps, 8 steps of: store 4 B to shared, barrier, two 4 B shared loads, barrier; then
    one warp stores 4 B. At 16 B a lane per wavefront: 8 x 2 x (1 + 2) / 4 + 1 / 4 = 12.25."""
    c = tir_counts.block_counts(_k_loop)
    assert (c.threads, c.shared_wavefronts, c.k_steps, c.pipelined_steps, c.barriers) == (64, 12.25, 8, 0, 16)
    # global: 8 coalesced loads of 2 warps (4 sectors each), then the store of c by both warps
    assert (c.global_requests, c.global_sectors) == (18, 72)


@T.prim_func(s_tir=True)
def _scaled_in_place(a_ptr: f32_ptr(), s_ptr: f32_ptr()):
    T.func_attr({"tirx.is_global_func": True, "tirx.noalias": True})
    a = T.decl_buffer((4096,), data=a_ptr)
    s = T.decl_buffer((1,), data=s_ptr)
    with T.launch_thread("blockIdx.x", 4) as bx:
        tile = T.alloc_shared((256,))
        tx = T.launch_thread("threadIdx.x", 64)
        for i in range(4):
            tile[i * 64 + tx] = a[bx * 1024 + i * 64 + tx]
        for i in range(4):
            T.tvm_storage_sync("shared")
            tile[i * 64 + tx] = tile[i * 64 + tx] / s[0]
        T.tvm_storage_sync("shared")
        a[bx * 1024 + tx] = tile[63 - tx]


def test_a_loop_invariant_load_is_not_a_k_step():
    """A row scaled in place by ``s[0]`` behind a barrier each iteration (a row chain's softmax
    normalisation): the scale does not move with the loop, so nothing new is waited for from
    global memory; the 4 iterations are barrier steps, not K steps."""
    c = tir_counts.block_counts(_scaled_in_place)
    assert (c.k_steps, c.pipelined_steps, c.barriers) == (0, 4, 5)


@T.prim_func(s_tir=True)
def _unrolled(a_ptr: f32_ptr(), c_ptr: f32_ptr()):
    T.func_attr({"tirx.is_global_func": True, "tirx.noalias": True})
    a = T.decl_buffer((4096,), data=a_ptr)
    c = T.decl_buffer((64,), data=c_ptr)
    with T.launch_thread("blockIdx.x", 4) as bx:
        acc = T.alloc_local((1,))
        tile = T.alloc_shared((64,))
        tx = T.launch_thread("threadIdx.x", 64)
        acc[0] = T.float32(0.0)
        tile[tx] = a[bx * 1024 + tx]
        T.tvm_storage_sync("shared")
        acc[0] = acc[0] + tile[tx] * tile[63 - tx]
        T.tvm_storage_sync("shared")
        tile[tx] = a[bx * 1024 + 64 + tx]
        T.tvm_storage_sync("shared")
        acc[0] = acc[0] + tile[tx] * tile[63 - tx]
        T.tvm_storage_sync("shared")
        tile[tx] = a[bx * 1024 + 128 + tx]
        T.tvm_storage_sync("shared")
        acc[0] = acc[0] + tile[tx] * tile[63 - tx]
        c[tx] = acc[0]


def test_a_k_loop_tvm_unrolled_is_counted_step_by_step():
    """The K loop above at 3 steps, unrolled as TVM unrolls short loops: each store of a global
    load in shared memory, then a barrier, is a step (they counted 0 before 2026-12-04)."""
    c = tir_counts.block_counts(_unrolled)
    assert (c.k_steps, c.pipelined_steps, c.barriers) == (3, 0, 5)


@T.prim_func(s_tir=True)
def _sectors(a_ptr: f32_ptr(), b_ptr: f32_ptr(), c_ptr: f32_ptr()):
    T.func_attr({"tirx.is_global_func": True, "tirx.noalias": True})
    a = T.decl_buffer((4096,), data=a_ptr)
    b = T.decl_buffer((4096,), data=b_ptr)
    c = T.decl_buffer((4096,), data=c_ptr)
    with T.launch_thread("blockIdx.x", 4) as bx:
        acc = T.alloc_local((4,))
        tx = T.launch_thread("threadIdx.x", 64)
        acc[0] = a[bx * 64 + tx]                      # coalesced: 4 sectors a warp
        for k in range(3):
            acc[1] = acc[1] + b[tx * 16 + k]           # a lane per 64-byte row: 32 sectors a warp
        acc[0:4] = a[T.Ramp(tx * 4, 1, 4)]            # 16 bytes a lane: 16 sectors a warp
        if tx < 8:
            c[bx * 8 + tx] = acc[0]                   # one warp, 8 lanes: 1 sector
        cse: T.let[T.int32] = tx * 2
        c[cse] = acc[1]                               # every other float: 8 sectors a warp


def test_global_sectors_are_counted_per_warp_request_by_hand():
    """Requests: 2 + 3 x 2 + 2 + 1 + 2 = 13; sectors: 2 x 4 + 3 x 2 x 32 + 2 x 16 + 1 + 2 x 8 = 249.
    The L1 floor: the busiest SM (4 blocks on 132 SMs: one) passes 249 sectors, four a clock."""
    c = tir_counts.block_counts(_sectors)
    assert (c.global_requests, c.global_sectors) == (13, 249)
    got = floors.block_floors(H200, grid=4, slots=264, counts=c)
    assert got["l1"] == pytest.approx(249 / 4 / 1.98e9)
    # a lane per row costs eight coalesced loads' L1 cycles
    row = BlockCounts(threads=256, global_requests=8, global_sectors=8 * 32)
    coalesced = BlockCounts(threads=256, global_requests=8, global_sectors=8 * 4)
    assert floors.block_floors(H200, 132, 264, row)["l1"] == pytest.approx(
        8 * floors.block_floors(H200, 132, 264, coalesced)["l1"])


@T.prim_func(s_tir=True)
def _prefetched(a_ptr: f32_ptr(), c_ptr: f32_ptr()):
    T.func_attr({"tirx.is_global_func": True, "tirx.noalias": True})
    a = T.decl_buffer((4096,), data=a_ptr)
    c = T.decl_buffer((128,), data=c_ptr)
    with T.launch_thread("blockIdx.x", 4) as bx:
        reg = T.alloc_local((1,))
        acc = T.alloc_local((1,))
        tile = T.alloc_shared((256,))
        tx = T.launch_thread("threadIdx.x", 128)
        acc[0] = T.float32(0.0)
        # a grid-stride loop over 10 tiles: block 3, the last, runs (10 - 3 + 3) // 4 = 2
        for it in range((10 - bx + 3) // 4):
            for ko in range(4):
                reg[0] = a[ko * 128 + tx]
                tile[tx * 2:tx * 2 + 2] = T.Broadcast(reg[0], 2)
                T.tvm_storage_sync("shared")
                acc[0] = acc[0] + tile[tx]
        c[tx] = acc[0]


def test_a_grid_stride_trip_counts_at_the_last_block_and_a_register_prefetch_is_pipelined():
    c = tir_counts.block_counts(_prefetched)
    # 2 trips x 4 steps; 4 warps; an 8 B vector store (0.5) and a 4 B load (0.25) a step
    assert (c.k_steps, c.pipelined_steps, c.barriers) == (0, 8, 8)
    assert c.shared_wavefronts == 2 * 4 * 4 * 0.75
    # block 0 runs (10 + 3) // 4 = 3 trips: the busiest block, which the kernel cannot end before
    assert (c.busiest.pipelined_steps, c.busiest.shared_wavefronts) == (12, 3 * 4 * 4 * 0.75)
    one_wave = floors.block_floors(H200, grid=4, slots=264, counts=c)
    assert one_wave["k_chain"] == pytest.approx((12 * BARRIER_CYCLES + 36) / 1.98e9)
    assert BlockCounts.from_dict(c.as_dict()) == c


def test_the_one_by_one_convolution_floors():
    """ResNeXt's conv at M = 196, N = 512, K = 1024 (docs/review-on-chip-and-latency.md §3): 208
    blocks of 16 warps, 2 on the busiest SM, 64 K steps, one ld.shared.v2 wavefront a k per warp:
    16.5 us of shared memory on the SM; one block alone waits 64 loads (6.5 us) and does its own
    8.3 us of shared reads between them; 3.1 us of arithmetic."""
    counts = BlockCounts(threads=512, shared_wavefronts=16 * 1024, k_steps=64)
    got = floors.block_floors(H200, grid=208, slots=264, counts=counts)
    assert got["shared"] == pytest.approx(2 * 16 * 1024 / 1.98e9)
    assert got["k_chain"] == pytest.approx((64 * floors.LOAD_LATENCY_CYCLES + 16 * 1024) / 1.98e9)
    stage = floors.stage_floors(H200, 208, 3_350_000, 2 * 196 * 512 * 1024)
    assert stage["arithmetic"] == pytest.approx(2 * (2 * 196 * 512 * 1024 / 208) / (67e12 / 132))
    assert stage["memory"] == pytest.approx(3_350_000 / H200.l2_bandwidth)
    # half the blocks' waves: a grid past the resident slots runs its chains one wave after another
    assert floors.block_floors(H200, 528, 264, counts)["k_chain"] == pytest.approx(2 * got["k_chain"])


def _kernel(counts=None, flops=1000, tiles=132, tensor_core=False):
    st = Stage(tiles, 256, 4096 * tiles, flops * tiles, tensor_core)
    return latency.Kernel("k", tiles, 256, 32, 0, (st,), counts=counts)


def test_a_prediction_below_its_floor_is_raised_to_it():
    """What the fitted terms give a kernel of little traffic and arithmetic is far below what its
    counted shared-memory wavefronts need: the model answers the floor, and says which."""
    loose = latency.kernel_time(H200, latency.FITTED, _kernel())
    counts = BlockCounts(threads=256, shared_wavefronts=1e6)
    tight = latency.kernel_time(H200, latency.FITTED, _kernel(counts))
    assert loose.seconds < 1e-6 * 5
    assert tight.floor_by == "shared" and tight.floor == pytest.approx(1e6 / 1.98e9)
    assert tight.seconds == tight.floor


def test_a_stage_is_never_below_its_floor_on_the_busiest_sm():
    """133 tiles on 132 SMs: one SM runs two tiles' arithmetic at its share of the peak."""
    st = Stage(133, 256, 1, 10**10)
    t = latency.stage_time(H200, latency.FITTED, st, 264)
    per_sm = H200.fp32_flops / H200.sms
    assert t.floor == pytest.approx(2 * 10**10 / 133 / per_sm)
    assert t.seconds >= t.floor


def test_a_stage_below_its_own_floor_is_raised_to_it():
    """The stage-level clamp, guarded: a stage whose tiles each need a million shared-memory
    wavefronts but wait on no K step gets almost nothing from the fitted terms (one round trip a
    wave); its shared floor (one wavefront a clock on its SM) is what it is given. Without the
    clamp in ``stage_time`` this stage is predicted about 700 times too fast."""
    st = Stage(132, 256, 132 * 1024, 132 * 1000, shared_wavefronts=1e6)
    t = latency.stage_time(H200, latency.FITTED, st, 132)
    assert t.floor == pytest.approx(1e6 / 1.98e9)
    assert t.seconds == t.floor
    assert latency.FITTED.latency_us * 1e-6 < t.floor / 100     # what the fitted terms alone give


def test_a_stitched_kernel_floor_is_its_stages_in_sequence():
    a = Stage(132, 256, 0, 10**9)
    b = Stage(132, 256, 0, 3 * 10**9, tensor_core=True)
    k = latency.Kernel("s", 132, 256, 32, 0, (a, b), grid_syncs=1)
    t = latency.kernel_time(H200, latency.FITTED, k)
    assert t.floor_by == "stages"
    assert t.floor == pytest.approx(sum(s.floor for s in t.stages) + floors.GRID_SYNC_CYCLES / H200.clock_hz)
    assert t.seconds >= t.floor


def test_a_stitched_kernel_waits_at_least_an_l2_round_trip_per_grid_sync():
    """The LSTM layer kernel's shape: 97 grid syncs between stages of little work, whose own floors
    are far below the syncs'; the syncs alone put the floor above 97 L2 round trips."""
    tiny = Stage(64, 256, 4096, 10**4)
    k = latency.Kernel("layer", 64, 256, 40, 0, (tiny,) * 98, grid_syncs=97)
    t = latency.kernel_time(H200, latency.FITTED, k)
    syncs = 97 * floors.GRID_SYNC_CYCLES / H200.clock_hz
    assert t.floor >= syncs and t.floor - syncs == pytest.approx(sum(s.floor for s in t.stages))
    assert t.seconds >= t.floor


def test_uncoalesced_sectors_are_priced_as_l2_traffic():
    """The same bytes, a lane per row: 8x a coalesced fp32 load's sectors cross from L2 (the BERT
    attention kernel's shape of 2026-11-29, 792 blocks of 152340 sectors); the sector term binds,
    above the L1 floor that assumes every sector hits L1, and is off in ``BEFORE``."""
    coalesced = BlockCounts(threads=256, global_requests=4761, global_sectors=4761 * 4)
    scattered = dataclasses.replace(coalesced, global_sectors=4761 * 32)
    def kernel(counts):
        st = Stage(792, 256, 18_284_546, 470_679_552)
        return latency.Kernel("attention", 792, 256, 34, 0, (st,), counts=counts)
    fast, slow = (latency.kernel_time(H200, latency.FITTED, kernel(c)) for c in (coalesced, scattered))
    moved = 792 * 4761 * 32 * 32
    assert latency.sector_seconds(H200, latency.FITTED, kernel(scattered)) == pytest.approx(moved / 6e12)
    assert slow.seconds == pytest.approx(moved / 6e12) and slow.seconds > 4 * slow.floor
    assert fast.seconds < slow.seconds / 5
    assert latency.kernel_time(H200, latency.BEFORE, kernel(scattered)).seconds < slow.seconds / 3
    # 18 blocks move their sectors through 18 SMs' share of L2's bandwidth, not all of it
    few = latency.Kernel("gemv", 18, 256, 34, 0, (Stage(18, 256, 8 << 20, 0),), counts=scattered)
    assert latency.sector_seconds(H200, latency.FITTED, few) == pytest.approx(
        18 * 4761 * 32 * 32 / (6e12 * 18 / 132))
    # a footprint that fits in the L1 beside the blocks' shared memory is fetched once per active
    # SM; re-reads hit L1
    small = dataclasses.replace(few, stages=(Stage(18, 256, 64 << 10, 0),))
    assert latency.sector_seconds(H200, latency.FITTED, small) == pytest.approx(18 * (64 << 10) / (6e12 * 18 / 132))


def test_sectors_counted_before_building_price_a_stage_like_its_kernel():
    """The partitioner prices stages before their kernels exist (``Stage.sectors``, from the
    counts of the group built alone): a lane-per-row stage costs what the same kernel with
    those counts costs; coalesced, an eighth of it; without counted sectors, its bytes alone."""
    st = Stage(792, 256, 18_284_546, 470_679_552, sectors=4761 * 32)
    counts = BlockCounts(threads=256, global_requests=4761, global_sectors=4761 * 32)
    alone = latency.stage_time(H200, latency.FITTED, st, slots=792)
    kernel = latency.kernel_time(H200, latency.FITTED, latency.Kernel("k", 792, 256, 34, 0,
                                                                       (dataclasses.replace(st, sectors=0.0),), counts=counts))
    assert alone.seconds == pytest.approx(792 * 4761 * 32 * 32 / 6e12) == pytest.approx(kernel.seconds)
    coalesced = latency.stage_time(H200, latency.FITTED, dataclasses.replace(st, sectors=4761 * 4), slots=792)
    assert coalesced.seconds == pytest.approx(alone.seconds / 8)
    assert latency.stage_time(H200, latency.FITTED, dataclasses.replace(st, sectors=0.0), 792).seconds < alone.seconds / 10
    assert latency.stage_time(H200, latency.BEFORE, st, 792).seconds < alone.seconds / 3


def test_report_rows_carry_counts_and_floors():
    rows = [{"name": "k", "grid": [208], "block": [512], "registers": 40, "shared_bytes": 8192, "launches": 22,
             "bytes": 3_350_000, "flops": 2 * 196 * 512 * 1024,
             "block_counts": {"threads": 512, "shared_wavefronts": 16384, "k_steps": 64, "pipelined_steps": 0,
                              "barriers": 128}}]
    (k,) = latency.kernels_from_rows(rows)
    t = latency.kernel_time(H200, latency.FITTED, k)
    # one block alone: 64 loads, its 16384 wavefronts and its own FMAs (a 208th of the GEMM at an
    # SM's 256 fp32 flops a clock) one after another, just above two blocks' wavefronts on one SM
    block = 2 * 196 * 512 * 1024 / 208 / (67e12 / 132 / 1.98e9)
    assert k.counts.k_steps == 64 and t.floor_by == "k_chain"
    assert t.floor == pytest.approx((64 * 200 + 16384 + block) / 1.98e9) and t.seconds >= t.floor
    assert t.floor > 2 * 16384 / 1.98e9
    assert math.isfinite(t.seconds)


@needs_nvcc
def test_small_resnext_time_driven_holds_every_kernel_to_its_floor():
    """Souffle's time-driven build (what ``auto`` weighs against TVM's), with ptxas: every kernel
    carries its block counts and floor, none is predicted below it; the K-chain term raises a
    K-looped kernel above what the other terms say, and the floors that bind include the K chain
    and the L1 data path (uncoalesced sectors)."""
    r = compile_model("resnext", "cuda", "souffle", small=True, level="v3", partitioner="time").report
    assert_floors_hold(r)
    kernels = latency.kernels_from_rows([dataclasses.asdict(k) for k in r.kernels])
    no_chain = dataclasses.replace(latency.FITTED, kstep_cycles=0.0)
    raised = [k.name for k in kernels if k.counts.k_steps
              and latency.kernel_time(H200, latency.FITTED, k).seconds
              > latency.kernel_time(H200, no_chain, k).seconds]
    assert raised
    assert {"k_chain", "l1"} <= {k.floor_by for k in r.kernels}
    # what a measured kernel is recorded with (latency.row_inputs, through JSON) prices it as the report did
    again = latency.kernels_from_rows([json.loads(json.dumps(latency.row_inputs(dataclasses.asdict(k))))
                                       for k in r.kernels])
    assert any(len(k.stages) > 1 for k in again)
    assert [round(latency.kernel_time(H200, latency.FITTED, k).seconds * 1e6, 4) for k in again] \
        == [k.predicted_us for k in r.kernels]
    # every kernel names its schedule form and whether a GPU ever ran it; the table and the
    # predicted time say what rests on forms no GPU has run
    assert all(k.form and k.measured_form is (k.form in measured.TIMED_IN_TOTALS) for k in r.kernels)
    untimed = [k for k in r.kernels if not k.measured_form]
    assert any(k.form.startswith("StitchedMatmul@") for k in untimed)
    assert 0 < r.latency["untimed_share"] < 1
    table = r.table()
    assert f"{untimed[0].name}*" in table and "schedule forms no GPU has run" in table


def test_forms_and_what_a_gpu_has_run():
    assert schedule.form_of("Matmul", None) == "dlight Matmul"
    assert schedule.form_of("Matmul", 512) == "StitchedMatmul@512"
    assert schedule.form_of("GeneralReduction", 256) == "RowReduction@256"
    assert measured.timed_in_a_total("dlight") and measured.timed_in_a_total("Fallback@256")
    assert not measured.timed_in_a_total("SerialReduction@256")
    assert not measured.timed_in_a_total("Fallback@256 + TensorCoreMatmul@256")
    assert not measured.timed_in_a_total(None)


def _conv_1x1(path):
    """ResNeXt's 1x1 convolution of the review (docs/review-on-chip-and-latency.md §3): 1024
    channels in, 512 out, 14 x 14: a GEMM of M = 196, N = 512, K = 1024."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = (np.random.default_rng(0).standard_normal((512, 1024, 1, 1)) / 32).astype("float32")
    g = helper.make_graph([helper.make_node("Conv", ["X", "W"], ["Y"], kernel_shape=[1, 1])], "conv1x1",
                          [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, 1024, 14, 14])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, 512, 14, 14])],
                          [numpy_helper.from_array(w, "W")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, path)
    return str(path)


@needs_nvcc
def test_the_review_1x1_convolution_is_priced_within_its_floors(tmp_path):
    """Both builds of the review's convolution run K = 1024 in 64 unpipelined steps of 16 (load to
    shared, barrier, FMAs, barrier): its K chain is a floor for both, and the fitted step cost a
    term for both. The model's gain of Souffle's kernel over TVM's can be no larger than TVM's
    prediction over Souffle's floor, and Souffle's is never priced below its chain at the fitted
    step cost."""
    path = _conv_1x1(tmp_path / "conv1x1.onnx")
    # the review's form: dlight's K tile (the default now takes 64 here: below)
    (ours,) = compile_model(path, "cuda", "souffle", gemm_k_tile=16).report.kernels
    (theirs,) = compile_model(path, "cuda", "tvm").report.kernels
    for k in (ours, theirs):
        assert k.block_counts["k_steps"] == 64 and k.floor_by == "k_chain"
        assert k.floor_us * 1e-6 >= 64 * floors.LOAD_LATENCY_CYCLES / H200.clock_hz
    chain = BlockCounts.from_dict(ours.block_counts).chain_cycles(latency.FITTED.kstep_cycles)
    assert ours.predicted_us * 1e-6 >= chain / H200.clock_hz
    assert theirs.predicted_us / ours.predicted_us <= theirs.predicted_us / ours.floor_us
    # the default's K tile: 16 steps of 64, each still priced at the fitted step cost
    (chosen,) = compile_model(path, "cuda", "souffle").report.kernels
    # (the block size, 256 or 512 threads, is the fitted constants' choice)
    assert re.fullmatch(r"StitchedMatmul@(256|512)/k64", chosen.form) and chosen.block_counts["k_steps"] == 16
    chain = BlockCounts.from_dict(chosen.block_counts).chain_cycles(latency.FITTED.kstep_cycles)
    assert chosen.floor_us <= chosen.predicted_us and chosen.predicted_us * 1e-6 >= chain / H200.clock_hz
    assert chosen.predicted_us < ours.predicted_us
