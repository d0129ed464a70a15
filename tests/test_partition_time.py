"""The time-driven partitioner (``partition.by_time``): boundaries where the latency model says
separate kernels are faster, stitching where syncs beat graph nodes."""

import dataclasses
from types import SimpleNamespace

import pytest

from souffle_tvm.cost import estimate, latency
from souffle_tvm.cost.hardware import GPUS
from souffle_tvm.partition.by_time import by_time
from souffle_tvm.partition.subprograms import GroupFacts
from souffle_tvm.cost.work import Stage

H200 = GPUS["h200"]
# Hand-picked, not the fit: syncs clearly cheaper than graph nodes (the fit has them the other
# way round, 1.16 against 0.54 us), so that stitching has something to win; a grid-stride tile
# restart as cheap as the fit finds it (0.1 us)
C = latency.Constants(launch_us=8.0, node_us=2.0, sync_us=0.7, mem_efficiency=0.7, warp_gbps=3.0,
                      flop_efficiency=0.3, tile_us=0.1)


def _groups(n):
    return [SimpleNamespace(opaque=None, members=[], name=f"g{i}") for i in range(n)]


def _facts(stages, regs):
    """One lowered stage per group: ``stages[i]`` its Stage, ``regs[i]`` its registers."""
    n = len(stages)
    return GroupFacts([None] * n, [10] * n, [[estimate.Estimate(r, 0, False)] for r in regs],
                      list(range(n)), [None] * n, [[s] for s in stages])


def test_small_stages_stitch_into_one_kernel():
    # an LSTM-like chain: 40 one-tile GEMVs, each far shorter than a graph node
    stages = [Stage(4, 256, 64 * 1024, 128 * 1024) for _ in range(40)]
    subs = by_time(_groups(40), _facts(stages, [40] * 40), H200, {}, constants=C)
    assert [idx for idx, _ in subs] == [list(range(40))]
    assert subs[0][1] == "end of model"


def test_register_hungry_gemm_is_cut_off_a_bandwidth_bound_stage():
    # a memory-bound stage of 20000 tiles wants 8 blocks per SM; stitched with a 255-register
    # GEMM it would run at that GEMM's single block per SM
    stream = Stage(20000, 256, 256 * 2**20, 0)
    gemm = Stage(512, 256, 8 * 2**20, 2 * 10**10, written_bytes=4 * 2**20)
    small = Stage(1, 256, 4096, 4096)
    subs = by_time(_groups(4), _facts([small, stream, gemm, small], [40, 40, 200, 40]), H200, {}, constants=C)
    kernels = [idx for idx, _ in subs]
    assert not any(1 in idx and 2 in idx for idx in kernels), kernels
    cut = next(why for idx, why in subs if idx[-1] in (1, 2) and len(subs) > 1)
    assert cut.startswith("time: separate kernels predicted faster") and " us as one kernel" in cut


def test_forced_cuts_and_unstitchable_groups_are_kept():
    stages = [Stage(1, 256, 4096, 4096) for _ in range(6)]
    facts = _facts(stages, [40] * 6)
    facts.unstitchable[3] = "its schedule uses 512 threads per block, the stitched kernel 256"
    subs = by_time(_groups(6), facts, H200, {}, forced={1: "ptxas feedback: spills; split after g1"}, constants=C)
    assert [idx for idx, _ in subs] == [[0, 1], [2], [3], [4, 5]]
    assert subs[0][1].startswith("ptxas feedback")
    assert subs[1][1].startswith("next group is not stitchable")
    assert subs[2][1].startswith("not stitchable")


def test_partition_minimises_predicted_time():
    # the chosen partition is never predicted slower than all-separate or all-stitched
    stages = [Stage(t, 256, b, f) for t, b, f in
              [(1, 4096, 10**4), (2000, 2**26, 10**6), (3, 10**5, 10**8), (1, 4096, 10**4), (800, 2**24, 10**9)]]
    regs = [40, 32, 200, 40, 120]
    facts = _facts(stages, regs)
    from souffle_tvm.partition.window_prices import Timer, Window

    timer = Timer(facts, H200, C)

    def cost(subs):
        total = 0.0
        for idx, _ in subs:
            if len(idx) == 1:
                total += timer.separate(idx[0])
            else:
                w = Window(timer, [set() for _ in stages], idx[0])
                for i in idx:
                    w.add(i)
                total += w.seconds()
        return total

    chosen = by_time(_groups(5), facts, H200, {}, constants=C)
    assert cost(chosen) <= cost([([i], "") for i in range(5)]) + 1e-12
    assert cost(chosen) <= cost([(list(range(5)), "")]) + 1e-12


def _predicted(name, level, partitioner):
    from souffle_tvm.pipeline.driver import compile as compile_model

    return compile_model(name, "cuda", "souffle", small=True, level=level, partitioner=partitioner).report


@pytest.mark.parametrize("name", ["mmoe", "bert", pytest.param("lstm", marks=pytest.mark.slow),
                                  pytest.param("swin", marks=pytest.mark.slow)])
def test_time_driven_v3_is_predicted_no_slower_than_v2_or_v3(name):
    """The partition minimises the model's time, and the groups it leaves alone keep whichever
    schedule (stitchable or v2's) the model predicts faster: the built kernels, with ptxas'
    figures, are predicted no slower than v2's or the budget partitioner's."""
    timed = _predicted(name, "v3", "time")
    for level, part in (("v2", "budget"), ("v3", "budget")):
        other = _predicted(name, level, part)
        assert timed.latency["graph_ms"] <= other.latency["graph_ms"] * 1.02, (level, part)
    assert all(s["reason"].startswith(("time:", "end of model", "not stitchable", "next group", "ptxas",
                                       "compile-time", "adding"))
               for s in timed.subprograms)

def test_the_default_keeps_the_build_predicted_faster():
    """``--level auto`` builds Souffle's v3 (time-driven) and TVM's own and keeps the faster under
    a CUDA graph; planting a slower prediction on Souffle's build makes TVM's the one returned,
    the fallback giving both figures."""
    from souffle_tvm.pipeline import driver

    auto = driver.compile("mmoe", "cuda", "souffle", small=True)
    assert auto.report.level == "v3" and auto.report.fallback is None
    assert auto.report.latency["graph_ms"] <= auto.report.latency["tvm_graph_ms"]
    ours = driver.compile("mmoe", "cuda", "souffle", small=True, level="v3", partitioner="time")
    theirs = driver.compile("mmoe", "cuda", "tvm", small=True)
    # planted: Souffle's kernels launched 50 times over, slower under every constant set
    ours.cost_kernels = [dataclasses.replace(k, launches=k.launches * 50) for k in ours.cost_kernels]
    ours.report.latency["graph_ms"] = theirs.report.latency["graph_ms"] * 2
    chosen = driver._faster_of(ours, theirs)
    assert chosen is theirs and chosen.report.fusion == "souffle"
    assert chosen.report.fallback.startswith("the latency model predicts TVM's own kernels faster")
    assert chosen.report.latency["souffle_graph_ms"] == ours.report.latency["graph_ms"]
    assert chosen.report.latency["choice"]["chosen"] == "tvm" and not chosen.report.latency["choice"]["uncertain"]


def test_a_measured_time_moves_a_boundary(tmp_path):
    from souffle_tvm.cost.measured import MeasuredTimes

    stream = Stage(20000, 256, 256 * 2**20, 0)
    gemm = Stage(512, 256, 8 * 2**20, 2 * 10**10, written_bytes=4 * 2**20)
    small = Stage(1, 256, 4096, 4096)
    facts = _facts([small, stream, gemm, small], [40, 40, 200, 40])
    facts.kernel_keys = ["k0", "k-stream", "k-gemm", "k3"]
    before = [idx for idx, _ in by_time(_groups(4), facts, H200, {}, constants=C)]
    assert [2, 3] in before
    # the GPU measured the GEMM alone at 1 us, far below the model: alone it is now cheaper
    db = MeasuredTimes()
    db.add("k-gemm", 1.0, gpu="H200", source="planted by the test")
    db.save(tmp_path / "measured.json")
    loaded = MeasuredTimes.load(tmp_path / "measured.json")
    after = [idx for idx, _ in by_time(_groups(4), facts, H200, {}, constants=C, measured=loaded)]
    assert [2] in after and [2, 3] not in after, (before, after)


def test_group_keys_match_the_built_kernels():
    """The key the partitioner asks for is the key of the kernel the build launches."""
    from souffle_tvm.cost import measured
    from souffle_tvm.core.targets import make_target
    from souffle_tvm.frontend.importer import import_onnx
    from souffle_tvm.pipeline import results
    from souffle_tvm.planning.group_calls import GroupCalls
    from souffle_tvm.pipeline.options import Options

    m = import_onnx("mmoe", small=True)
    target = make_target("cuda", "sm_90")
    sm = results.run(m.mod, target, m.params, Options(level="v3", partitioner="time"))
    facts = sm.group_facts
    assert facts.kernel_keys and all(k is None or k.startswith("sm_90|") for k in facts.kernel_keys)
    calls = GroupCalls(sm.unstitched, sm.partition.groups)
    i = next(i for i, k in enumerate(facts.kernel_keys) if k is not None)
    func = calls.func(i).with_attr("global_symbol", "renamed")     # names do not count
    st = facts.work[i][0]
    assert measured.kernel_key(func, "sm_90", st.tiles, st.threads) == facts.kernel_keys[i]


@pytest.mark.parametrize("constants", [C, latency.FITTED], ids=["syncs-cheap", "fitted"])
def test_the_sweep_prices_every_window_as_growing_it_does(constants):
    """``_Sweep`` prices all windows from one start in a few array passes; the partition and
    every reason (with its figures) must be the ones growing each window group by group gives,
    on random chains with data edges, rolled repeats, forced cuts, unstitchable groups,
    register-hungry and spilling stages and a tight compile-time budget."""
    import random

    rng = random.Random(7)
    for _ in range(120):
        n = rng.randint(1, 28)
        stages = [Stage(rng.choice([1, 3, 40, 132, 396, 2000, 20000]), 256,
                                rng.choice([4096, 10**5, 10**7, 2**27]), rng.choice([0, 10**4, 10**8, 10**10]),
                                rng.random() < 0.2, rng.choice([0, 4096, 10**6]))
                  for _ in range(n)]
        regs = [rng.choice([24, 40, 64, 96, 128, 200, 250]) for _ in range(n)]
        facts = _facts(stages, regs)
        facts.stages = [[estimate.Estimate(r, rng.choice([0, 0, 8192, 49152, 200000]), rng.random() < 0.05)]
                        for r in regs]
        for i in range(n):
            if rng.random() < 0.2:    # a group of two launch regions
                facts.stages[i] = facts.stages[i] * 2
                facts.work[i] = facts.work[i] * 2
        facts.statements = [rng.randint(1, 40) for _ in range(n)]
        facts.repeat_of = [rng.randrange(i) if i and rng.random() < 0.4 else None for i in range(n)]
        facts.unstitchable = [("its schedule uses 512 threads" if rng.random() < 0.08 else None) for _ in range(n)]
        groups = [SimpleNamespace(opaque=None, members=[SimpleNamespace(op=f"op{i}")], name=f"g{i}") for i in range(n)]
        readers = {f"op{i}": [f"op{j}" for j in range(i + 1, n) if rng.random() < 0.3] for i in range(n)}
        forced = {i: f"ptxas feedback: split after g{i}" for i in range(n) if rng.random() < 0.05}
        budget = dict(max_groups=rng.choice([3, 6, 64]), max_statements=rng.choice([50, 120, 10**6]))
        swept = by_time(groups, facts, H200, readers, forced=forced, constants=constants, **budget)
        grown = by_time(groups, facts, H200, readers, forced=forced, constants=constants, sweep=False, **budget)
        assert swept == grown
