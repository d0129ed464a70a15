"""V4: stitched kernels prefetch the next segment's inputs into L2 before the grid sync that precedes it.

The prefetches must be placed one segment ahead of their first reader, cover only buffers the
kernel never writes, stay within the L2 share, reach the CUDA source as ``prefetch.global.L2``,
and change nothing the kernel computes (emulated against onnxruntime). Run in the emulator
(runtime.prefetch_probe), the lines they touch lie inside the buffers named and cover what the
next segment reads first; planted faults (addresses shifted, a trip count cut, a loop a segment
early) are caught there and nowhere else."""

import dataclasses
import math

import pytest
import tvm
import tvm_ffi
from tvm import tirx

from souffle_tvm.pipeline import driver as api
from souffle_tvm.cost import hardware
from souffle_tvm.pipeline import results as pipeline
from souffle_tvm.pipeline.options import Options
from souffle_tvm.stitch import prefetch
from souffle_tvm.stitch import kernel_ir
from souffle_tvm.runtime import prefetch_probe, races, runner
from souffle_tvm.frontend.importer import import_onnx
from souffle_tvm.core.targets import make_target
from conftest import emulated_comparisons

CUDA = make_target("cuda")


@pytest.fixture(scope="module")
def bert_v4():
    m = import_onnx("bert", small=True, dtype="float32")
    # 64-wide GEMM tiles, the kernel whose 14 prefetch loops the tests below count
    return m, pipeline.run(m.mod, CUDA, m.params, Options(level="v4", gemm_tile=64))


def _buffers_read(stmt) -> list:
    found = []
    tvm_ffi.structural_walk(stmt, (tvm.ir.TensorLoad, lambda x: found.append(x.source)))
    return found


def _prefetched(stmt):
    """The memory (data pointer) a prefetch loop covers (through a flat view of the buffer)."""
    decls = []
    tvm_ffi.structural_walk(stmt, (tirx.DeclBuffer, lambda d: decls.append(d.data)))
    return decls[0]


def test_prefetches_run_one_segment_ahead_of_their_first_reader(bert_v4):
    _, souffle = bert_v4
    func = souffle.mod[souffle.stitched[0].function]
    seq = kernel_ir.stage_loops(func)
    loops = [i for i, s in enumerate(seq) if kernel_ir.is_prefetch(s)]
    assert loops, "no prefetch planted"
    segment_of, seg = [], 0
    for s in seq:
        seg += kernel_ir.is_grid_sync(s)
        segment_of.append(seg)
    stages = [i for i, s in enumerate(seq) if not kernel_ir.is_prefetch(s) and not kernel_ir.is_grid_sync(s)]
    stored = []
    for i in stages:
        tvm_ffi.structural_walk(seq[i], (tirx.BufferStore, lambda x: stored.append(x.buffer)))
    for i in loops:
        data = _prefetched(seq[i])
        same = lambda b: tvm_ffi.structural_equal(data, b.data)  # noqa: E731
        assert not any(same(b) for b in stored), f"{data} is written by the kernel"
        readers = [j for j in stages if any(same(b) for b in _buffers_read(seq[j]))]
        assert readers, f"{data} is prefetched but never read"
        assert segment_of[readers[0]] == segment_of[i] + 1, f"{data}: not one segment ahead of its first reader"
        assert kernel_ir.is_grid_sync(seq[i + 1]) or kernel_ir.is_prefetch(seq[i + 1]), "a prefetch not right before a sync"
    planned = prefetch.plan(kernel_ir.strip_prefetch(func), hardware.for_arch("sm_90").l2_bytes)
    assert len(planned) == len(loops)
    # Counted from BERT small's structure (hidden 64, ffn 128, 2 layers, fp32), not from plan: a
    # layer's weights are Q, K, V, O (64 x 64 + 64 each), the FFN (64 x 128 + 128, 128 x 64 + 64),
    # two LayerNorms (2 x 64 each) and 4 scalars (sqrt(d_head), GELU's sqrt(2), 1, 0.5): 33476
    # elements. Every one is an input its segment reads first, so all are prefetched except what
    # the first segment reads (nothing runs before it): the first layer's Q, K, V GEMM. With the
    # attention one row chain (7 stages a layer, not 9), both layers fit the compile-time budget:
    # ONE kernel runs the model.
    layer = 4 * (64 * 64 + 64) + (64 * 128 + 128) + (128 * 64 + 64) + 2 * 2 * 64 + 4
    first_segment = 3 * (64 * 64 + 64)
    assert len(souffle.subprograms) == 1 and souffle.subprograms[0][1] == "end of model"
    assert souffle.stitched[0].prefetched_bytes == 4 * (2 * layer - first_segment) == 217888


def test_the_l2_share_caps_what_one_segment_prefetches(bert_v4):
    _, souffle = bert_v4
    func = kernel_ir.strip_prefetch(souffle.mod[souffle.stitched[0].function])
    full = prefetch.plan(func, 60 * 2**20)
    largest = max(p.bytes for p in full)
    capped = prefetch.plan(func, int(largest / prefetch.L2_SHARE) - 1)    # the largest no longer fits
    assert all(p.bytes < largest for p in capped)
    per_segment: dict = {}
    for p in capped:
        per_segment[p.segment] = per_segment.get(p.segment, 0) + p.bytes
    assert max(per_segment.values()) <= (largest / prefetch.L2_SHARE - 1) * prefetch.L2_SHARE
    assert prefetch.plan(func, 0) == []


def test_v4_emulated_matches_the_reference_and_v3_kernel_count():
    m = import_onnx("mmoe", small=True, dtype="float32")
    souffle = pipeline.run(m.mod, CUDA, m.params, Options(level="v4"))
    assert sum(k.prefetched_bytes for k in souffle.stitched) > 0
    for cmp in emulated_comparisons(m, souffle.mod, souffle.params):
        assert cmp.finite and cmp.rel_l2 < 1e-5, cmp
    emu, report, _ = _prefetch_run(m, souffle)       # and the lines its prefetch loops touch
    assert emu.sites == len(report.sites) > 0 and report.ok, str(report)
    func = souffle.mod[souffle.stitched[0].function]   # the kernel alone, on random arguments
    lone = prefetch_probe.PrefetchEmulation(tvm.IRModule({"k": func}), CUDA)
    _, alone = lone.run(races.arguments(func))
    assert lone.lone == "k" and alone.ok and len(alone.sites) == lone.sites == emu.sites, str(alone)
    v3 = pipeline.run(m.mod, CUDA, m.params, Options(level="v3"))
    assert [k.stages for k in v3.stitched] == [k.stages for k in souffle.stitched]
    assert all(k.prefetched_bytes == 0 for k in v3.stitched)


def test_v4_cuda_source_issues_l2_prefetches_and_the_report_counts_them():
    c = api.compile("mmoe", "cuda", "souffle", small=True, level="v4", nvcc=False)
    assert "prefetch.global.L2" in c.cuda_source
    assert sum(k.prefetched_bytes or 0 for k in c.report.kernels) > 0
    v3 = api.compile("mmoe", "cuda", "souffle", small=True, level="v3", nvcc=False)
    assert "prefetch.global.L2" not in v3.cuda_source
    assert v3.report.launches == c.report.launches


def test_v4_on_the_cpu_twin_is_v3():
    llvm = make_target("llvm")
    m = import_onnx("mmoe", small=True, dtype="float32")
    v4 = pipeline.run(m.mod, llvm, m.params, Options(level="v4"))
    assert not v4.stitched and not v4.subprograms


def test_feedback_drops_the_prefetch_of_a_kernel_before_splitting_it(bert_v4):
    """ptxas feedback at V4: a kernel over budget first loses its prefetch loops (V3's form of
    it), keeping its subprogram; only what still does not fit is split."""
    _, souffle = bert_v4
    k = souffle.stitched[0]
    again = pipeline.restitch(souffle, CUDA, dataclasses.replace(souffle.feedback, no_prefetch=frozenset({k.name})))
    assert again.subprograms == souffle.subprograms
    assert again.feedback.no_prefetch == {k.name}
    (k2,) = [x for x in again.stitched if x.name == k.name]
    assert k2.prefetched_bytes == 0
    assert not any(kernel_ir.is_prefetch(s) for s in kernel_ir.stage_loops(again.mod[k2.function]))


# --- The prefetch loops run in the emulator (issue 20, part 5): runtime.prefetch_probe ------------
def _prefetch_run(m, souffle, mod=None):
    emu = prefetch_probe.PrefetchEmulation(mod or souffle.mod, CUDA)
    feeds = runner.random_inputs(m.inputs, 0)
    outs, report = emu.run(runner.check_feeds(m.inputs, feeds), souffle.params)
    _, ref = runner.reference_outputs(m.onnx_model, feeds)
    return emu, report, runner.compare(m.outputs, outs, ref)


def test_v4_prefetches_lie_inside_their_buffers_and_cover_the_next_segments_first_reads(bert_v4):
    """Every line each prefetch loop of BERT's V4 kernel touches, recorded in the emulator: inside
    the buffer named, one segment ahead of its first reader, covering all it reads."""
    m, souffle = bert_v4
    func = souffle.mod[souffle.stitched[0].function]
    loops = [s for s in kernel_ir.stage_loops(func) if kernel_ir.is_prefetch(s)]
    emu, report, cmp = _prefetch_run(m, souffle)
    # per layer, what each segment after the first reads first: the scale (attention), W_O, the
    # LayerNorm's b_O, gamma and beta, the FFN's W_1, b_1 and GELU's three scalars, W_2, the second
    # LayerNorm's three; and the second layer's Q, K, V weight and bias: 14 + 2 + 14
    assert emu.sites == len(loops) == 30
    assert report.ok, str(report)
    assert report.calls == 1 and len(report.sites) == len(loops)     # one kernel, called once
    # each loop prefetched the whole buffer it names, and the next segment reads all of it:
    # the line counts come from the buffers' shapes, not from the probe
    lines = {str(p.name): -(-math.prod(int(d) for d in p.ty.shape) * 4 // prefetch.LINE_BYTES) for p in func.params
             if hasattr(p, "ty") and hasattr(p.ty, "shape")}
    for site in report.sites:
        assert site.prefetched == site.read_next == lines[site.buffer], site
        assert site.first_read == site.segment + 1 and site.outside == 0 and not site.missing
    assert sum(s.prefetched for s in report.sites) * prefetch.LINE_BYTES >= souffle.stitched[0].prefetched_bytes
    assert all(c.finite and c.rel_l2 < 1e-5 for c in cmp), cmp


def _planted(souffle, change):
    """``souffle.mod`` with the stitched kernel's stage sequence passed through ``change``."""
    gv = souffle.mod.get_global_var(souffle.stitched[0].function)
    func = souffle.mod[gv]
    broken = kernel_ir.replace_stages(func, change(func, kernel_ir.stage_loops(func)))
    return tvm.IRModule({g: (broken if g.same_as(gv) else f) for g, f in souffle.mod.functions.items()},
                        attrs=souffle.mod.attrs)


def _the_loop_of(seq, name: str) -> int:
    return next(i for i, s in enumerate(seq) if kernel_ir.is_prefetch(s) and
                kernel_ir.calls_to(s, ["tirx.ptx.prefetch"])[0].args[0].args[0].source.name == name + "_lines")


def _shift(func, seq):
    """w_4's loop prefetches each line one line further on (its first line never, one past its end)."""
    i = _the_loop_of(seq, "w_4")
    loop = seq[i]

    def shifted(call):
        if kernel_ir.op_name(call) != "tirx.ptx.prefetch":
            return call
        load = call.args[0].args[0]
        moved = tirx.BufferLoad(load.source, [load.indices[0] + tirx.const(32, "int64")])
        return tvm.ir.Call(call.op, [tirx.address_of(moved)] + list(call.args[1:]))
    return seq[:i] + [tvm_ffi.structural_map(loop, (tvm.ir.Call, shifted))] + seq[i + 1:]


def _cut(func, seq):
    """w_4's loop counts one line fewer (256 - 1): its last line is never prefetched."""
    i = _the_loop_of(seq, "w_4")
    loop = seq[i]
    bid, grid = kernel_ir.launch_var(func, "blockIdx.x")
    tid, block = kernel_ir.launch_var(func, "threadIdx.x")
    i64 = lambda v: tirx.const(v, "int64")  # noqa: E731
    threads = grid * block
    trip = tirx.floordiv(i64(256 - 1) - (bid * i64(block) + tid) + i64(threads - 1), i64(threads))
    cut = tirx.For(loop.loop_var, loop.min, trip, loop.kind, loop.body, annotations=loop.annotations)
    return seq[:i] + [cut] + seq[i + 1:]


def _early(func, seq):
    """w_4's loop planted one segment early (before the grid sync ahead of its own)."""
    i = _the_loop_of(seq, "w_4")
    sync = max(j for j in range(i) if kernel_ir.is_grid_sync(seq[j]) and
               not all(kernel_ir.is_prefetch(s) for s in seq[j + 1:i]))
    return seq[:sync] + [seq[i]] + seq[sync:i] + seq[i + 1:]


@pytest.mark.parametrize("fault,found", [
    (_shift, ["issued 1 address(es) outside the buffer, the first at element 8192", "misses 1 of the 256 line(s)"]),
    (_cut, ["misses 1 of the 256 line(s)"]),
    (_early, ["is first read by segment 4, not 3"]),
])
def test_planted_prefetch_faults_are_caught(bert_v4, fault, found):
    """A prefetch has no semantics: the emulated numerics still match with each fault; only the
    prefetch check sees it, on the loop that has it (w_4's first-layer loop) alone."""
    m, souffle = bert_v4
    _, report, cmp = _prefetch_run(m, souffle, _planted(souffle, fault))
    assert all(c.finite and c.rel_l2 < 1e-5 for c in cmp), cmp
    assert not report.ok
    problems = report.problems
    assert all("prefetch of w_4" in p for p in problems) and len(problems) == len(found), problems
    for text in found:
        assert any(text in p for p in problems), (text, problems)
