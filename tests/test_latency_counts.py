"""The block counts the latency fit reads for the replayed plans (data/latency/counts-tvm.json,
written by souffle_experiments.latency_counts from today's builds): every kernel of TVM's plans is covered,
a hand-counted GEMM carries the K steps its TIR has, and souffle_experiments.latency_fit attaches them.
No builds: the committed JSON is read."""

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "data"
LATENCY = DATA / "latency"

from souffle_experiments import latency_fit


@pytest.fixture(scope="module")
def counts():
    return json.loads((LATENCY / "counts-tvm.json").read_text())


@pytest.fixture(scope="module")
def tvm_cases():
    plans = json.loads((LATENCY / "plans-44fa44f.json").read_text())
    return {c["id"]: c for c in plans["cases"] if c["fusion"] == "tvm"}


def test_every_tvm_plan_kernel_has_counts_or_a_mismatch(counts, tvm_cases):
    assert counts["arch"] == "sm_90" and counts["built_at"]
    assert len(tvm_cases) == 12
    for cid, case in tvm_cases.items():
        have = counts["cases"].get(cid, {})
        for k in case["kernels"]:
            listed = any(m.startswith(f"{cid} {k['name']}:") for m in counts["mismatches"])
            assert (k["name"] in have) != listed, (cid, k["name"], "needs counts or a mismatch line, not both")
        assert set(have) <= {k["name"] for k in case["kernels"]}, cid
        for c in have.values():
            assert {"threads", "shared_wavefronts", "k_steps", "pipelined_steps", "barriers"} <= set(c)


def test_bert_full_gemms_carry_their_hand_counted_k_steps(counts):
    bert = counts["cases"]["bert-full-tvm"]
    # matmul2 (attention probs [12,384,384] x V [12,384,64], float16, no tensor cores; grid 12x12,
    # block 8x16): dlight's lowered TIR has one serial loop `for ax3_0 in range(24)` (K = 384 in
    # steps of 16) whose body is a barrier, the A and B tiles stored from global straight into
    # shared memory, a barrier, and the FMAs: 24 unpipelined K steps, 48 barriers.
    m = bert["matmul2_kernel"]
    assert (m["threads"], m["k_steps"], m["pipelined_steps"], m["barriers"]) == (128, 24, 0, 48)
    # fused_matmul_add (hidden [384,768] x W [768,768], wmma; block 32x16): K = 768 in tiles of 64,
    # the first loaded before `for ax3_0_0 in range(11)`, whose global loads go to registers and
    # reach shared memory after the tile's compute: 11 pipelined steps, none unpipelined;
    # barriers 2 x 11 + 1 before the loop + 2 around the epilogue.
    m = bert["fused_matmul_add_kernel"]
    assert (m["threads"], m["k_steps"], m["pipelined_steps"], m["barriers"]) == (512, 0, 11, 25)


def test_the_fit_attaches_the_counts():
    points, _ = latency_fit.load_points()
    point = next(p for p in points if p["id"] == "bert-full-tvm")
    by_name = {k.name: k for k in point["kernels"]}
    assert by_name["matmul2_kernel"].counts.k_steps == 24
    assert by_name["fused_matmul_add_kernel"].counts.pipelined_steps == 11
    tvm = [k for p in points if p["fusion"] == "tvm" and p["commit"] == latency_fit.TVM_PLANS for k in p["kernels"]]
    assert tvm and all(k.counts is not None for k in tvm)


def test_the_fit_loads_without_the_counts_file(tmp_path):
    (tmp_path / "latency").mkdir()
    (tmp_path / "gpu").symlink_to(DATA / "gpu")
    for plans in LATENCY.glob("plans-*.json"):
        (tmp_path / "latency" / plans.name).symlink_to(plans)
    points, _ = latency_fit.load_points(tmp_path)
    with_counts, _ = latency_fit.load_points()
    assert len(points) == len(with_counts) > 0
    assert all(k.counts is None for p in points for k in p["kernels"])
