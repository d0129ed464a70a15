"""The race checker (runtime.races): what counts as a race on small hand-written kernels, in
every order; and faults planted in stitched kernels, each checked by the three detectors we
have: the static check (stitch.check, which asks the proof that placed the barriers), the
race checker (which knows nothing of that proof) and the emulated numerics against
onnxruntime. docs/emulator.md has the table these tests assert."""

import numpy as np
import pytest
import tvm
from tvm.script import tirx as T

from test_two_phase import gemm_then
from souffle_tvm.core.targets import make_target
from souffle_tvm.frontend import importer as frontend
from souffle_tvm.pipeline import results as pipeline
from souffle_tvm.pipeline.options import Options
from souffle_tvm.runtime import races, runner
from souffle_tvm.stitch import check as stitch_check, dependence, kernel_ir

CUDA = make_target("cuda")
ORDERS = ("ascending", "descending", "shuffle:5")
RAW, WAR, WAW, ATOM = "read after write", "write after read", "write after write", "plain access and atomic"


def f32(n: int):
    """A float32 parameter of ``n`` elements (a fresh buffer per parameter) for the small kernels."""
    return T.Buffer((n,), "float32")


# -- small kernels: what counts as a race --------------------------------------------------------
@T.prim_func
def disjoint(a: f32(8), out: f32(8)):
    bx = T.launch_thread("blockIdx.x", 2)
    tx = T.launch_thread("threadIdx.x", 4)
    out[bx * 4 + tx] = a[bx * 4 + tx] * T.float32(2)


@T.prim_func
def blocks_share_an_element(a: f32(8), out: f32(4)):
    bx = T.launch_thread("blockIdx.x", 2)
    tx = T.launch_thread("threadIdx.x", 4)
    out[tx] = a[bx * 4 + tx]


@T.prim_func
def neighbour(a: f32(8), out: f32(8)):
    bx = T.launch_thread("blockIdx.x", 2)
    tx = T.launch_thread("threadIdx.x", 4)
    a[bx * 4 + tx] = T.float32(1)
    out[bx * 4 + tx] = a[bx * 4 + (tx + 1) % 4]


@T.prim_func
def neighbour_after_a_barrier(a: f32(8), out: f32(8)):
    bx = T.launch_thread("blockIdx.x", 2)
    tx = T.launch_thread("threadIdx.x", 4)
    a[bx * 4 + tx] = T.float32(1)
    T.tvm_storage_sync("shared")
    out[bx * 4 + tx] = a[bx * 4 + (tx + 1) % 4]


@T.prim_func
def next_block_after_a_grid_sync(a: f32(8), out: f32(8)):
    bx = T.launch_thread("blockIdx.x", 2)
    tx = T.launch_thread("threadIdx.x", 4)
    a[bx * 4 + tx] = T.float32(1)
    T.cuda.grid_sync()
    out[bx * 4 + tx] = a[(bx + 1) % 2 * 4 + tx]


@T.prim_func
def next_block(a: f32(8), out: f32(8)):
    bx = T.launch_thread("blockIdx.x", 2)
    tx = T.launch_thread("threadIdx.x", 4)
    a[bx * 4 + tx] = T.float32(1)
    out[bx * 4 + tx] = a[(bx + 1) % 2 * 4 + tx]


@T.prim_func
def shared_neighbour(a: f32(8), out: f32(8)):
    # no barrier written: the CUDA build's ThreadSync puts one before the read, and so does the checker
    bx = T.launch_thread("blockIdx.x", 2)
    tx = T.launch_thread("threadIdx.x", 4)
    s = T.alloc_shared((4,), "float32")
    s[tx] = a[bx * 4 + tx]
    out[bx * 4 + tx] = s[(tx + 1) % 4]


@T.prim_func
def atomic_sum(a: f32(8), out: f32(2)):
    bx = T.launch_thread("blockIdx.x", 2)
    tx = T.launch_thread("threadIdx.x", 4)
    T.cuda.atomic_add(T.address_of(out[0]), a[bx * 4 + tx])
    out[1] = T.float32(2)      # every thread stores the same value: counted apart, as benign


@T.prim_func
def atomic_sum_read_early(a: f32(8), out: f32(8)):
    bx = T.launch_thread("blockIdx.x", 2)
    tx = T.launch_thread("threadIdx.x", 4)
    T.cuda.atomic_add(T.address_of(out[0]), a[bx * 4 + tx])
    if tx == 3:
        out[bx * 4 + 1] = out[0]


SMALL = [(disjoint, set()), (blocks_share_an_element, {("blocks", WAW)}), (neighbour, {("threads", RAW)}),
         (neighbour_after_a_barrier, set()), (next_block, {("blocks", RAW), ("blocks", WAR)}),
         (next_block_after_a_grid_sync, set()), (shared_neighbour, set()), (atomic_sum, set()),
         (atomic_sum_read_early, {("blocks", ATOM), ("threads", ATOM)})]


@pytest.mark.parametrize("func,expected", SMALL, ids=[str(f.attrs["global_symbol"]) for f, _ in SMALL])
def test_races_in_small_kernels_whatever_the_order(func, expected):
    emu = races.Emulation(tvm.IRModule({"k": func}), CUDA)
    for order in ORDERS:
        _, report = emu.run(races.arguments(func), order=order)
        assert {(r.level, r.kind) for r in report.races} == expected, (order, str(report))
        assert report.ok == (not expected)


def test_same_value_rewrites_are_counted_apart():
    report = races.check(atomic_sum, CUDA, "descending")
    assert report.ok and report.benign == 7 and "same-value" in str(report)


@T.prim_func
def last_writer(a: f32(16), out: f32(2)):
    bx = T.launch_thread("blockIdx.x", 4)
    tx = T.launch_thread("threadIdx.x", 4)
    if bx == 0:
        out[0] = a[tx]           # the last thread to run wins
    if tx == 0:
        out[1] = a[bx * 4]       # the last block to run wins


def test_blocks_and_threads_run_in_the_order_asked():
    emu = races.Emulation(tvm.IRModule({"k": last_writer}), CUDA)
    a = np.arange(16, dtype="float32")
    seen = {}
    for order in ORDERS + (races.Order(blocks="descending", threads="ascending"),):
        outs, report = emu.run([a, np.zeros(2, "float32")], order=order)
        assert not report.ok and report.kinds() == {("threads", WAW, "out"), ("blocks", WAW, "out")}
        seen[str(races.Order.of(order))] = tuple(outs[1])
    assert seen["ascending"] == (3, 12) and seen["descending"] == (0, 0)
    assert seen["blocks descending, threads ascending"] == (3, 0)


def test_orders_are_named_or_seeded():
    assert races.Order.of("shuffle:7") == races.Order(7, 7) == races.Order.of(7)
    assert str(races.Order.of(3)) == "shuffle:3"
    with pytest.raises(ValueError, match="order"):
        races.Order.of("backwards")


def test_a_module_with_main_needs_its_inputs():
    _, s = _two_phase("softmax")
    with pytest.raises(ValueError, match="inputs"):
        races.check(s.mod, CUDA)


def test_the_checker_does_not_import_the_proof():
    """Independence: neither module of the race checker imports stitch.dependence or stitch.check."""
    import ast
    import inspect

    from souffle_tvm.runtime import race_probe

    for module in (races, race_probe):
        tree = ast.parse(inspect.getsource(module))
        names = {a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
        names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not any(x.split(".")[-1] in ("dependence", "check") for x in names if x), (module.__name__, names)


# -- faults planted in stitched kernels: who catches them ----------------------------------------
@pytest.fixture(scope="module")
def bert(v3_builds):
    return v3_builds("bert")


_BUILDS: dict = {}


def _two_phase(kind: str, **options):
    key = (kind, tuple(sorted(options.items())))
    if key not in _BUILDS:
        m = frontend.import_onnx(gemm_then(kind))
        _BUILDS[key] = m, pipeline.run(m.mod, CUDA, m.params, Options(level="v3", **options))
    return _BUILDS[key]


def _with_kernel(souffle, name: str, func):
    return tvm.IRModule({g: (func if g.name_hint == name else f) for g, f in souffle.mod.functions.items()},
                        attrs=souffle.mod.attrs)


def _detected(m, souffle, mod) -> tuple[bool, bool, set]:
    """(race checker, emulated numerics, race kinds): the race verdict must not depend on the block
    order; the numerics count as caught if either order misses the reference (rel L2 1e-5)."""
    emu = races.Emulation(mod, CUDA)
    feeds = runner.random_inputs(m.inputs, 0)
    _, ref = runner.reference_outputs(m.onnx_model, feeds)
    verdicts, wrong, kinds = set(), False, set()
    for order in ("ascending", "descending"):
        outs, report = emu.run(runner.check_feeds(m.inputs, feeds), souffle.params, order)
        verdicts.add(report.ok)
        kinds |= {(r.level, r.kind) for r in report.races}
        wrong = wrong or not all(c.finite and c.rel_l2 < 1e-5 for c in runner.compare(m.outputs, outs, ref))
    assert len(verdicts) == 1, "the race verdict depends on the order"
    return not verdicts.pop(), wrong, kinds


def _static(func, grid: int) -> bool:
    return bool(stitch_check.check(func, grid, None).problems)


def _without(func, drop):
    """``func`` without the top-level statements ``drop(i, stmt, seq)`` picks."""
    seq = kernel_ir.stage_loops(func)
    return kernel_ir.replace_stages(func, [s for i, s in enumerate(seq) if not drop(i, s, seq)])


def _first_grid_sync(i, s, seq):
    return i == next(j for j, x in enumerate(seq) if kernel_ir.is_grid_sync(x))


def test_a_removed_grid_sync(bert):
    """(i) The first grid sync of bert's stitched kernel removed: all three catch it."""
    m, s = bert
    k = s.stitched[0]
    broken = _without(s.mod[k.function], _first_grid_sync)
    race, numerics, kinds = _detected(m, s, _with_kernel(s, k.function, broken))
    assert (_static(broken, k.grid), race, numerics) == (True, True, True)
    assert ("blocks", RAW) in kinds or ("blocks", WAR) in kinds


@pytest.mark.parametrize("kind", ["softmax", "layernorm"])
def test_a_removed_block_barrier(kind):
    """(ii) The __syncthreads() between a GEMM and its block-local partials removed: the static
    check and the race checker catch it; lock step hides it from the numerics."""
    m, s = _two_phase(kind, onchip=False)      # the GEMM's tile in global memory (test_onchip: on chip)
    k = s.stitched[0]
    broken = _without(s.mod[k.function], lambda i, x, seq: dependence.is_block_barrier(x))
    race, numerics, kinds = _detected(m, s, _with_kernel(s, k.function, broken))
    assert (_static(broken, k.grid), race, numerics) == (True, True, False)
    assert ("threads", RAW) in kinds


@pytest.mark.parametrize("kind", ["softmax", "layernorm"])
def test_a_removed_block_barrier_before_an_on_chip_tile(kind):
    """(ii') The same barrier removed where the GEMM's tile is on chip (a shared buffer): the
    static check still asks for it; on the GPU TVM's ThreadSync puts a __syncthreads() back
    before the shared-memory read (the race checker runs the same pass first and so sees no
    race), and the numerics hold."""
    m, s = _two_phase(kind)
    k = s.stitched[0]
    assert k.onchip_bytes > 0
    broken = _without(s.mod[k.function], lambda i, x, seq: dependence.is_block_barrier(x))
    race, numerics, _ = _detected(m, s, _with_kernel(s, k.function, broken))
    assert (_static(broken, k.grid), race, numerics) == (True, False, False)


def _wrong_proof(monkeypatch, wrong_for):
    """``dependence.barrier_needed`` answering NONE where the true answer is in ``wrong_for``."""
    real = dependence.barrier_needed

    def wrong(*args):
        need = real(*args)
        return dependence.NONE if need in wrong_for else need
    monkeypatch.setattr(dependence, "barrier_needed", wrong)


def test_a_wrong_block_locality_proof(monkeypatch):
    """(iii) The proof says a partial needs no barrier after its GEMM (it needs __syncthreads):
    the static check asks the same proof and passes the kernel; the race checker catches it."""
    m = frontend.import_onnx(gemm_then("softmax"))
    _wrong_proof(monkeypatch, (dependence.BLOCK,))
    s = pipeline.run(m.mod, CUDA, m.params, Options(level="v3", onchip=False))
    k = s.stitched[0]
    func = s.mod[k.function]
    assert not any(dependence.is_block_barrier(x) for x in kernel_ir.stage_loops(func))
    static = _static(func, k.grid)
    assert k.safety.ok and not static
    monkeypatch.undo()
    assert _static(func, k.grid)            # with the true proof, the check would have said so
    race, numerics, kinds = _detected(m, s, s.mod)
    assert (static, race, numerics) == (False, True, False)
    assert ("threads", RAW) in kinds


def test_a_proof_that_needs_no_barrier_at_all(monkeypatch, bert):
    """(iii') Every dependence 'proved' barrier-free: bert's stitched kernel loses all its grid
    syncs; the static check (same proof) passes it, the race checker and the numerics do not."""
    m, _ = bert
    _wrong_proof(monkeypatch, (dependence.BLOCK, dependence.GRID))
    s = pipeline.run(m.mod, CUDA, m.params, Options(level="v3"))
    k = s.stitched[0]
    func = s.mod[k.function]
    assert k.grid_syncs == 0 and not kernel_ir.has_grid_sync(func)
    static = _static(func, k.grid)
    monkeypatch.undo()
    race, numerics, kinds = _detected(m, s, s.mod)
    assert (static, race, numerics) == (False, True, True)
    assert _static(func, k.grid)


def test_atomic_sums_read_before_a_grid_sync():
    """(iv) The grid sync between the atomic row sums and their reader removed (the atomic
    two-phase LayerNorm): the intact kernel's atomics race with nothing; the broken one's
    reads of the sums race with the atomic adds, and all three catch it."""
    m, s = _two_phase("layernorm", reduction="atomic")
    k = s.stitched[0]
    assert _detected(m, s, s.mod)[:2] == (False, False)
    func = s.mod[k.function]
    last = max(i for i, x in enumerate(kernel_ir.stage_loops(func)) if kernel_ir.is_grid_sync(x))
    broken = _without(func, lambda i, x, seq: i == last)
    race, numerics, kinds = _detected(m, s, _with_kernel(s, k.function, broken))
    assert (_static(broken, k.grid), race, numerics) == (True, True, True)
    assert ("blocks", ATOM) in kinds


def test_tensor_core_stitched_kernel_has_no_race():
    """The fp16 MLP stitched on tensor cores: wmma loads and stores (lane 0's accesses for its
    warp) through shared tiles, with ThreadSync's barriers, race with nothing."""
    from test_tensorcore import _mlp

    m = frontend.import_onnx(_mlp(), dtype="float16")
    s = pipeline.run(m.mod, CUDA, m.params, Options(level="v3"))
    assert s.stitched
    feeds = runner.random_inputs(m.inputs, 0)
    emu = races.Emulation(s.mod, CUDA)
    for order in ("ascending", "shuffle:2"):
        _, report = emu.run(runner.check_feeds(m.inputs, feeds), s.params, order)
        assert report.ok and not report.benign, str(report)
