"""GPU semantics on the CPU: the stitched kernels themselves run (emulated) and match the reference,
blocks and threads in three orders, with no race (runtime.races); planted faults (a missing grid
sync, a grid-stride indexing error) are caught by the numerics (tests/test_races.py: by the race
checker)."""

import pytest
import tvm
from tvm import tirx
import tvm_ffi

from conftest import emulated_comparisons, race_checked_in_orders, zoo_but_slow
from souffle_tvm.runtime import emulate
from souffle_tvm.stitch import kernel_ir
from souffle_tvm.core.targets import make_target
from souffle_tvm.errors import EmulationError

CUDA = make_target("cuda")
ORDERS = ("ascending", "descending", "shuffle:1")


def _run_emulated(m, souffle, mod=None):
    return emulated_comparisons(m, mod or souffle.mod, souffle.params)


@pytest.fixture(scope="module")
def bert(v3_builds):
    return v3_builds("bert")


# Swin (~100 s) and the LSTM (~35 s) run in `make test-all`; BERT, ResNeXt, EfficientNet and
# MMoE cover the same stitched forms (channels included) in the default suite.
@pytest.mark.parametrize("name", zoo_but_slow("swin", "lstm"))
def test_emulated_kernels_match_the_reference_in_three_orders_without_a_race(name, v3_builds):
    """One race-checked build per model, run with blocks (and threads) ascending, descending and
    shuffled: the numerics match in every order and the checker sees no race in any kernel."""
    m, souffle = v3_builds(name)
    assert souffle.stitched, "no stitched kernel to emulate"
    for order, report, comparisons in race_checked_in_orders(m, souffle, ORDERS):
        assert report.ok, str(report)
        assert all((k.function or k.name) in report.kernels for k in souffle.stitched)
        for cmp in comparisons:
            assert cmp.finite and cmp.rel_l2 < 1e-5, (order, cmp)


def _replace_stitched(souffle, func):
    mod = souffle.mod
    gv = mod.get_global_var("souffle_stitched_0")
    out = tvm.IRModule({g: (func if g.same_as(gv) else f) for g, f in mod.functions.items()}, attrs=mod.attrs)
    return out


def test_a_missing_grid_sync_is_caught(bert):
    m, souffle = bert
    func = souffle.mod["souffle_stitched_0"]
    seq = kernel_ir.stage_loops(func)
    first = next(i for i, s in enumerate(seq) if kernel_ir.is_grid_sync(s))
    broken = kernel_ir.replace_stages(func, seq[:first] + seq[first + 1:])
    cmp = _run_emulated(m, souffle, _replace_stitched(souffle, broken))
    assert not all(c.ok(1e-5) for c in cmp)


@pytest.mark.slow      # ~30 s; the missing-grid-sync fault above already shows faults are caught by default
def test_a_grid_stride_indexing_error_is_caught(bert):
    m, souffle = bert
    func = souffle.mod["souffle_stitched_0"]
    bid = func.body.node.var                    # blockIdx.x of the stitched kernel
    seq = kernel_ir.stage_loops(func)
    # inside the first stage loop (its trip count untouched), the virtual block id it*G + bid
    # becomes it*G + bid // 2: some virtual blocks run twice, others never
    loop = seq[0]
    body = tvm_ffi.structural_map(loop.body, (tirx.Var, lambda v: tirx.floordiv(v, tirx.const(2, "int64"))
                                              if v.same_as(bid) else v))
    planted = tirx.For(loop.loop_var, loop.min, loop.extent, loop.kind, body)
    cmp = _run_emulated(m, souffle, _replace_stitched(souffle, kernel_ir.replace_stages(func, [planted] + seq[1:])))
    assert not all(c.ok(1e-5) for c in cmp)


def test_a_barrier_under_a_thread_condition_is_refused(bert):
    _, souffle = bert
    func = souffle.mod["souffle_stitched_0"]
    seq = kernel_ir.stage_loops(func)
    tid = func.body.body.node.var
    i = next(i for i, s in enumerate(seq) if not kernel_ir.is_grid_sync(s) and kernel_ir.calls_to(s, kernel_ir.BARRIERS))
    guarded = tirx.IfThenElse(tid < tirx.const(128, "int64"), seq[i], None)
    with pytest.raises(EmulationError, match="barrier|grid sync"):
        emulate.emulate_primfunc(kernel_ir.replace_stages(func, seq[:i] + [guarded] + seq[i + 1:]), CUDA)
