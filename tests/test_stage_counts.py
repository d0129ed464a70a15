"""A stitched kernel's stages priced as the partitioner priced them: each stage with what one block
of its tiles executes (its global sectors, K steps and shared wavefronts, counted with the stage
stitched alone at the kernel's block size), not only the whole kernel's counts, which are of its
busiest and last blocks with every stage together."""

import dataclasses

import pytest

from souffle_tvm.cost import latency
from souffle_tvm.core.geometry import STITCH_BLOCK
from souffle_tvm.cost.hardware import GPUS
from souffle_tvm.pipeline import driver, feedback
from souffle_tvm.report import assemble
from conftest import needs_nvcc
from souffle_tvm.cost.work import BlockCounts, Stage

H200 = GPUS["h200"]


def test_the_busiest_blocks_sectors_cross_its_one_sm():
    """A 132-block kernel whose block 0 alone moves 93,187 sectors (small ResNeXt's stitched
    kernel: a matrix-vector stage of two tiles): those cross one SM's share of L2's bandwidth,
    not all of it."""
    busiest = BlockCounts(threads=256, global_requests=10734, global_sectors=93187)
    counts = BlockCounts(threads=256, global_requests=4, global_sectors=7, busiest=busiest)
    k = latency.Kernel("k", 132, 256, 170, 8324, (Stage(132, 256, 1 << 20, 10**6),) * 2, 1,
                       counts=counts)
    one_sm = 93187 * 32 / (12e12 * 0.5 / 132)
    assert latency.sector_seconds(H200, latency.FITTED, k) == pytest.approx(one_sm)
    assert latency.kernel_time(H200, latency.FITTED, k).seconds >= one_sm
    spread = dataclasses.replace(k, counts=dataclasses.replace(counts, busiest=None, global_sectors=93187 // 132))
    assert latency.sector_seconds(H200, latency.FITTED, spread) < one_sm / 100


@pytest.fixture(scope="module")
def resnext_v3():
    """Small ResNeXt at v3 (budget partitioner), with what ``settle`` built."""
    kept = {}
    real = driver.settle

    def settle(imported, souffle, target, use_nvcc):
        kept["built"] = real(imported, souffle, target, use_nvcc)
        kept["imported"], kept["target"] = imported, target
        return kept["built"]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(driver, "settle", settle)
        kept["compiled"] = driver.compile("resnext", "cuda", "souffle", small=True, level="v3")
    return kept


@needs_nvcc
def test_a_stitched_stage_carries_the_counts_the_partitioner_priced(resnext_v3):
    built = resnext_v3["built"]
    report = assemble.render(built.facts)
    checked = 0
    for sk in (k for k in built.souffle.stitched if len(k.stages) > 1):
        (row,) = [r for r in report.kernels if r.primfunc == sk.function][:1]
        assert len(sk.counted_alone) == len(sk.stages) == len(row.stage_plan)
        for plan, alone in zip(row.stage_plan, sk.counted_alone):
            assert alone is not None and alone["tiles"] == plan["tiles"]
            assert plan["k_steps"] == alone["k_steps"] and plan["shared_wavefronts"] == alone["shared_wavefronts"]
            if not plan.get("onchip_bytes"):
                assert plan["sectors"] == alone["sectors"]
                checked += 1
            else:     # read partly on chip: the sectors of the bytes left off chip
                assert plan["sectors"] <= alone["sectors"]
        # and they reach the model: the stages priced from the report's rows carry them
        (kernel,) = latency.kernels_from_rows([dataclasses.asdict(row)])
        assert [s.sectors for s in kernel.stages] == [p["sectors"] for p in row.stage_plan]
        assert any(a["sectors"] > 0 for a in sk.counted_alone)     # counted, not zeros
    assert checked > 0


@needs_nvcc
def test_the_report_prices_what_the_feedback_loop_priced(resnext_v3):
    """The feedback loop prices the build's facts directly; the report is rendered from them once.
    Read back from the report's rows (as an experiment reads a saved report), every kernel is the
    very kernel the loop priced: stages, counts, launches, resources."""
    built = resnext_v3["built"]
    rows = [dataclasses.asdict(r) for r in assemble.render(built.facts).kernels]
    assert any(k.stage_plan for k in built.facts.kernels) and any(k.counts for k in built.facts.kernels)
    assert latency.kernels_from_rows(rows) == built.facts.cost_kernels()
    compiled = resnext_v3["compiled"].report
    assert compiled.latency["graph_ms"] == pytest.approx(built.facts.graph_seconds() * 1e3, abs=1e-4)


@needs_nvcc
def test_the_block_size_chosen_is_not_priced_slower_once_built(resnext_v3):
    """The partitioner's windows put small ResNeXt's stitched kernel at 128 threads: its
    matrix-vector stage (two tiles at 256, four at 128) moves its lane-per-row sectors through
    twice the SMs. Built at the partition's 256 as well, the report prices the chosen size no
    slower. Before each stage carried its counts, the report priced the 256-thread build 88.9 us
    against 98.4 at the size chosen: the kernel's counts put the busiest block's sectors
    across all 132 SMs."""
    built, imported, target = resnext_v3["built"], resnext_v3["imported"], resnext_v3["target"]
    souffle = built.souffle
    arch = str(target.attrs["arch"])
    resized = {tuple(souffle.subprograms[k.index][0]) for k in souffle.stitched if k.block != STITCH_BLOCK}
    assert resized, "small ResNeXt's stitched kernel kept 256 threads: nothing to compare"
    chosen = built.facts.graph_seconds()
    fb = dataclasses.replace(souffle.feedback, partition_block=souffle.feedback.partition_block | resized,
                             grids=None, estimated_grids=True, min_blocks={})
    again = feedback._rebuild(imported, built, target, fb, True)
    grids = feedback.coresident_grids(again.facts, again.souffle)
    if grids:       # as settle does: the grid its ptxas figures allow
        fb = dataclasses.replace(again.souffle.feedback,
                                 grids={k.name: grids.get(k.function, k.grid) for k in again.souffle.stitched})
        again = feedback._rebuild(imported, again, target, fb, True)
    assert {k.block for k in again.souffle.stitched if len(k.stages) > 1} == {STITCH_BLOCK}
    assert again.facts.arch == arch
    assert chosen <= again.facts.graph_seconds()


@needs_nvcc
def test_the_partitioner_prices_the_window_as_the_report_prices_its_kernel(resnext_v3):
    """The window the partitioner priced and the kernel built from it, at the block size taken:
    within 2% (small ResNeXt at 128 threads: 97.8 against 98.4 us). Priced without the on-chip
    credits and block-local reads at that size, the window paid 3 grid syncs the stitcher does
    not put: 103.0 us."""
    from souffle_tvm.partition import window_prices
    from souffle_tvm.partition.groups import readers_of

    built, target = resnext_v3["built"], resnext_v3["target"]
    souffle = built.souffle
    gpu = GPUS["h200"]
    report = assemble.render(built.facts)
    producers = window_prices.producers_of(souffle.partition.groups, readers_of(souffle.program))
    compared = 0
    for sk in (k for k in souffle.stitched if len(k.stages) > 1):
        timer = souffle.at_sizes.timers[sk.block]
        window = window_prices.window_seconds(timer, producers, souffle.subprograms[sk.index][0]) - timer.node
        (row,) = [r for r in report.kernels if r.primfunc == sk.function][:1]
        (kernel,) = latency.kernels_from_rows([dataclasses.asdict(row)])
        priced = latency.kernel_time(gpu, latency.FITTED, kernel).seconds
        assert window == pytest.approx(priced, rel=0.02), (sk.function, sk.block, window, priced)
        compared += 1
    assert compared


@needs_nvcc
def test_a_resized_kernels_form_names_its_block_size(resnext_v3):
    """The form a kernel's time is kept by (and ``measured_form`` judged by) is its stages'
    schedules at the kernel's block size: small ResNeXt's v3 kernel runs 128 threads, and was
    reported as 256-thread forms (read from the partition's schedules)."""
    import re

    kernels = [k for k in resnext_v3["compiled"].report.kernels if k.cooperative]
    assert any(k.block[0] != STITCH_BLOCK for k in kernels), "no resized kernel to check"
    for kr in kernels:
        sizes = {int(n) for n in re.findall(r"@(\d+)", kr.form)}
        assert sizes == {kr.block[0]}, (kr.form, kr.block)


@needs_nvcc
@pytest.mark.slow      # the emulator counts every block: ~40 s
@pytest.mark.xfail(strict=True, reason="the static per-block sectors undercount: measured 2026-12-08 on small "
                   "ResNeXt v3, emulated / (tiles x planned) from 1.0 to 4.3 on the 13 stages read from global "
                   "memory alone (issue 58, item 4: not yet resolved)")
def test_a_stages_planned_sectors_match_the_emulators_independent_count():
    """Issue 58, item 4: the stage plan's sectors checked against a count that does not come from
    the data it was built from. The plan carries what one block of a stage's tiles executes, from
    the static walk of ``cost.tir_counts``; the emulator (``runtime.traffic``) counts the 32-byte
    sectors every warp request of every block of the built kernel touches, stage by stage. A stage
    reading and writing global memory alone (no channel) moves at most ``tiles`` times one full
    block's sectors and more than ``tiles - 1`` times (one tile may be an edge tile)."""
    report = driver.compile("resnext", "cuda", "souffle", small=True, level="v3", count_traffic=True).report
    compared = 0
    for row in (k for k in report.kernels if k.stage_plan and len(k.stage_plan) > 1):
        emulated = row.counted["stages"]
        assert len(emulated) == len(row.stage_plan)
        for plan, counted in zip(row.stage_plan, emulated):
            if plan.get("onchip_bytes") or not counted["sectors_exact"]:
                continue
            tiles, per_block = plan["tiles"], plan["sectors"]
            assert (tiles - 1) * per_block < counted["sectors"] <= tiles * per_block, (plan, counted)
            compared += 1
    assert compared >= 10
