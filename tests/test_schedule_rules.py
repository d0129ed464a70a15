"""Our schedule rules (``souffle_tvm/codegen/rules/``) follow dlight's ``ScheduleRule`` contract:
``is_target_available`` (CUDA only) and ``apply(func, target, tunable)`` returning a Schedule, or
None where the rule does not apply; ``schedule_group`` tries them in order, records the rules
that raise in ``Scheduled.notes`` and moves on.

``TensorCoreMatmul``'s applying case is in test_tensorcore.py, which pays the one-time import
of TVM's tensor intrinsics (about 15 s) anyway.
"""

import pytest
import tvm_ffi
from tvm import s_tir, te, tirx
from tvm.s_tir import dlight as dl

from souffle_tvm.codegen import schedule
from souffle_tvm.codegen.rules import AtomicRows, ColumnReduction, StitchedMatmul, PartialRows, SerialReduction, TensorCoreMatmul
from souffle_tvm.core.ir_names import ATOMIC_ATTR, TILE_ATTR
from souffle_tvm.core.targets import make_target
from souffle_tvm.errors import ScheduleError

CUDA = make_target("cuda")
LLVM = make_target("llvm")
RULES = [AtomicRows(), PartialRows(), TensorCoreMatmul(), StitchedMatmul(), ColumnReduction(256), SerialReduction(256)]


def _gemm(m=128, n=128, k=128, dtype="float32"):
    a = te.placeholder((m, k), dtype, name="A")
    w = te.placeholder((k, n), dtype, name="W")
    r = te.reduce_axis((0, k), "k")
    c = te.compute((m, n), lambda i, j: te.sum(a[i, r] * w[r, j], axis=r), name="C")
    return te.create_prim_func([a, w, c])


def _elementwise():
    x = te.placeholder((128, 256), "float32", name="X")
    return te.create_prim_func([x, te.compute((128, 256), lambda i, j: x[i, j] * 2.0, name="Y")])


def _row_sum(attrs=None):
    """S[b, i] = sum_k X[b, i, k]: an inner reduction, marked like two_phase's stages."""
    x = te.placeholder((4, 128, 256), "float32", name="X")
    k = te.reduce_axis((0, 256), "k")
    s = te.compute((4, 128), lambda b, i: te.sum(x[b, i, k], axis=k), name="S", attrs=attrs)
    return te.create_prim_func([x, s])


def _partial_rows():
    """P[0, i, j] = sum of X[0, i, j*64 : j*64 + 64]: two_phase's first phase with a 64 tile."""
    x = te.placeholder((1, 128, 256), "float32", name="X")
    kk = te.reduce_axis((0, 64), "kk")
    p = te.compute((1, 128, 4), lambda b, i, j: te.sum(x[b, i, j * 64 + kk], axis=kk), name="P",
                   attrs={TILE_ATTR: 64})
    return te.create_prim_func([x, p])


def _column_gemv(inner=False):
    """y[j] = sum_k x[k] W[k, j] (the column case), or W laid out [N, K] (``inner``)."""
    x = te.placeholder((256,), "float32", name="x")
    w = te.placeholder((512, 256) if inner else (256, 512), "float32", name="W")
    k = te.reduce_axis((0, 256), "k")
    y = te.compute((512,), lambda j: te.sum(x[k] * (w[j, k] if inner else w[k, j]), axis=k), name="y")
    return te.create_prim_func([x, w, y])


def _thread_tags(func):
    tags = set()
    tvm_ffi.structural_walk(func.body, (tirx.For, lambda f: tags.add(str(f.thread_binding.thread_tag))
                                        if f.thread_binding is not None else None))
    tvm_ffi.structural_walk(func.body, (tirx.AttrStmt, lambda a: tags.add(str(a.node.thread_tag))
                                        if a.attr_key == "thread_extent" else None))
    return tags


@pytest.mark.parametrize("rule", RULES, ids=lambda r: type(r).__name__)
def test_rules_are_dlight_rules_available_on_cuda_only(rule):
    assert isinstance(rule, dl.ScheduleRule)
    assert rule.is_target_available(CUDA)
    assert not rule.is_target_available(LLVM)
    assert rule.apply(_gemm(), LLVM, False) is None


# (rule, a function it schedules, one it does not apply to)
CASES = {
    "AtomicRows": (AtomicRows(), lambda: _row_sum({TILE_ATTR: 64, ATOMIC_ATTR: 1}), lambda: _row_sum()),
    "PartialRows": (PartialRows(), _partial_rows, lambda: _row_sum({TILE_ATTR: 64, ATOMIC_ATTR: 1})),
    "StitchedMatmul": (StitchedMatmul(), _gemm, _elementwise),
    "ColumnReduction": (ColumnReduction(256), _column_gemv, lambda: _column_gemv(inner=True)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_rule_applies_or_returns_none(name):
    rule, applies, not_applies = CASES[name]
    with CUDA:
        assert rule.apply(not_applies(), CUDA, False) is None
        sch = rule.apply(applies(), CUDA, False)
    assert isinstance(sch, s_tir.Schedule)
    assert {"blockIdx.x", "threadIdx.x"} <= _thread_tags(sch.mod["main"])


def test_tensor_core_rule_leaves_fp32_and_small_gemms():
    with CUDA:
        assert TensorCoreMatmul().apply(_gemm(), CUDA, False) is None                       # fp32
        assert TensorCoreMatmul().apply(_gemm(64, 64, 64, "float16"), CUDA, False) is None  # too small
        no_tc = _gemm(dtype="float16").with_attr("dlight.do_not_tensorize", True)
        assert TensorCoreMatmul().apply(no_tc, CUDA, False) is None


def test_atomic_rows_returns_a_schedule_of_its_launch_form_function():
    with CUDA:
        sch = AtomicRows().apply(_row_sum({TILE_ATTR: 64, ATOMIC_ATTR: 1}), CUDA, False)
    out = sch.mod["main"]
    assert out.attrs["tirx.is_scheduled"]
    assert "atomicAdd" in out.script() or "atomic_add" in out.script()
    done = schedule.schedule_group(_row_sum({TILE_ATTR: 64, ATOMIC_ATTR: 1}), CUDA, 256)
    assert done.rule == "AtomicRows" and done.notes == [] and done.failures == 0
    assert tvm_ffi.structural_equal(done.func, out)


def test_rule_names_as_reports_show_them():
    assert schedule.schedule_group(_gemm(), CUDA, 256).rule == "Matmul"        # StitchedMatmul
    assert schedule.schedule_group(_gemm(), CUDA).rule == "Matmul"             # dlight's
    assert schedule.schedule_group(_partial_rows(), CUDA, 256).rule == "PartialRows"
    assert schedule.schedule_group(_column_gemv(), CUDA, 256).rule == "ColumnReduction"
    llvm = schedule.schedule_group(_gemm(), LLVM)
    assert llvm.rule == "none" and llvm.notes == [] and llvm.failures == 0


class Boom(dl.ScheduleRule):
    def apply(self, func, target, tunable):
        raise RuntimeError("first line\nthe rule's reason")


def test_a_raising_rule_is_noted_by_name_and_the_next_rule_is_used(monkeypatch):
    plain = schedule.schedule_group(_elementwise(), CUDA, 256)
    real = schedule.default_rules
    monkeypatch.setattr(schedule, "default_rules", lambda bs, k=None, t=None: [Boom(), *real(bs, k, t)])
    done = schedule.schedule_group(_elementwise(), CUDA, 256)
    assert done.rule == plain.rule
    assert done.notes[0] == "Boom: RuntimeError the rule's reason"
    assert done.failures == plain.failures + 1
    assert tvm_ffi.structural_equal(done.func, plain.func)


def test_when_every_rule_raises_the_error_names_them(monkeypatch):
    monkeypatch.setattr(schedule, "default_rules", lambda bs, k=None, t=None: [Boom(), Boom()])
    with pytest.raises(ScheduleError, match="no dlight rule schedules it: Boom: RuntimeError the rule's reason; Boom"):
        schedule.schedule_group(_elementwise(), CUDA, 256)


def test_rules_unavailable_for_the_target_are_not_tried(monkeypatch):
    class NotHere(Boom):
        def is_target_available(self, target):
            return False

    real = schedule.default_rules
    monkeypatch.setattr(schedule, "default_rules", lambda bs, k=None, t=None: [NotHere(), *real(bs, k, t)])
    assert schedule.schedule_group(_gemm(), CUDA, 256).notes == []


def test_rules_that_raise_are_counted_in_the_report_and_named_in_the_reasons():
    """LSTM's gate epilogues make dlight's Matmul raise when fused: the partitioner splits them,
    the reason names the rule and its exception, and the report counts every such failure."""
    from souffle_tvm.pipeline.driver import compile as compile_model

    rep = compile_model("lstm", "cuda", "souffle", small=True, level="v2", nvcc=False).report
    assert rep.rule_failures > 0
    assert any("(Matmul: AssertionError" in g["reason"] for g in rep.groups)
    assert rep.to_json()["rule_failures"] == rep.rule_failures


def test_a_k1_gemm_never_gets_its_epilogue_in_the_reduction_init():
    """TVM 0.27 inlines ``+ bias`` into both the init and the update of a reduction of extent 1
    (found by the fuzzer: the emulated kernels were off by the bias): such a schedule is refused."""
    from tvm import te

    from souffle_tvm.codegen.emit import group_primfunc
    from souffle_tvm.partition.groups import Group

    a = te.placeholder((12, 1), "float32", name="a")
    w = te.placeholder((1, 4), "float32", name="w")
    b = te.placeholder((4,), "float32", name="b")
    k = te.reduce_axis((0, 1), name="k")
    mm = te.compute((12, 4), lambda i, j: te.sum(a[i, k] * w[k, j], axis=k), name="matmul")
    out = te.compute((12, 4), lambda i, j: mm[i, j] + b[j], name="bias")
    func, _ = group_primfunc(Group([mm, out]), [out])
    for block in (None, 256):
        try:
            done = schedule.schedule_group(func, CUDA, block)
        except Exception:      # noqa: BLE001 - no rule left is fine too: the partitioner splits
            continue
        assert not schedule.epilogue_in_init(done.func), (block, done.rule)


def test_a_contraction_of_one_tensor_with_itself_gets_a_gemm_schedule():
    """Attention's Q K^T reads both operands from the one fused QKV projection (composed slices
    and transposes): the group PrimFunc reads it through two parameters, so the GEMM rule sees
    a contraction of two buffers (one parameter: dlight's Fallback, one output per thread)."""
    from souffle_tvm.codegen import emit
    from souffle_tvm.frontend.importer import import_onnx
    from souffle_tvm.partition.groups import Group
    from souffle_tvm.te import analysis, program as te_program, rewrite
    from souffle_tvm.transforms import horizontal, vertical

    m = import_onnx("bert", small=True)
    prog = vertical(horizontal(te_program.lower(m.mod, weight_values=m.params)).program).program
    qk = next(t for t in prog.stages() if analysis.classify(t.op)[0] == analysis.REDUCTION
              and len({p.op for p, _ in rewrite.loads(t.op.body[0])}) == 1)
    func, externals = emit.group_primfunc(Group([qk]), [qk])
    assert len(externals) == 2 and externals[0].same_as(externals[1])
    assert [str(p.name) for p in func.params][:2] == [externals[0].op.name, externals[0].op.name + "_operand1"]
    assert schedule.schedule_group(func, CUDA, 256).rule == "Matmul"
