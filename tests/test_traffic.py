"""Traffic counted per buffer, never per name (issue 30, item 1).

topi names an activation's input and output ``compute`` alike, so a group PrimFunc often has two
parameters of one name; keyed by name, one of them vanished from the report's bytes (ResNeXt's
Souffle build reported about 263 MB where its buffers hold about 363 MB)."""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.script import tirx as T

from souffle_tvm.build import executable
from souffle_tvm.core import tir_stats
from souffle_tvm.core.targets import make_target
from souffle_tvm.report import assemble


@T.prim_func(s_tir=True)
def _relu(a: T.Buffer((64, 64), "float32"), b: T.Buffer((64, 64), "float32")):
    for i, j in T.grid(64, 64):
        with T.sblock("compute"):
            vi, vj = T.axis.remap("SS", [i, j])
            b[vi, vj] = T.max(a[vi, vj], T.float32(0))


def _same_named(func: tirx.PrimFunc, name: str = "compute") -> tirx.PrimFunc:
    """``func`` with every buffer parameter named ``name``, as topi's activations come."""
    subst = {p: tirx.Var(name, p.ty) for p in func.params}
    body = tvm_ffi.structural_map(func.body, (tirx.Var, lambda v: subst.get(v, v)))
    return tirx.PrimFunc([subst[p] for p in func.params], body, attrs=func.attrs)


SIZE = 64 * 64 * 4


def test_footprints_of_two_same_named_parameters_count_both():
    func = _same_named(_relu)
    assert [str(p.name) for p in func.params] == ["compute", "compute"]
    assert tir_stats.block_footprints(func) == {0: SIZE, 1: SIZE}
    assert tir_stats.written_param_bytes(func) == SIZE          # only the output is stored to
    assert tir_stats.heaviest_block(func) == ("compute", 64 * 64, 2 * SIZE, SIZE)


def test_distinct_param_names_renames_only_the_repeats():
    func = tir_stats.distinct_param_names(_same_named(_relu))
    assert [str(p.name) for p in func.params] == ["compute", "compute_1"]
    assert tir_stats.block_footprints(func) == {0: SIZE, 1: SIZE}
    assert tir_stats.distinct_param_names(_relu) is _relu


def _module(func: tirx.PrimFunc) -> tvm.IRModule:
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([64, 64], "float32"))
    with bb.function("main", [x]):
        gv = bb.add_func(func, "relu")
        with bb.dataflow():
            y = bb.emit_output(relax.call_tir(gv, [x], relax.TensorType([64, 64], "float32")))
        bb.emit_func_output(y)
    return bb.get()


def test_a_cuda_kernel_with_two_same_named_buffers_reports_both():
    """The device kernel declares both buffers as ``compute``: its report counts input and output."""
    target = make_target("cuda")
    mod = _module(_same_named(_relu))
    result = executable.build(mod, target)
    (kernel,) = [k for k in result.kernels if k.primfunc == "_relu"]
    assert kernel.global_buffers == {0: SIZE, 1: SIZE}
    assert kernel.stored == {1}
    report = assemble.cuda_report("relu", target, result, None, {"available": False, "seconds": 0, "note": ""})
    (kr,) = [k for k in report.kernels if k.primfunc == "_relu"]
    assert (kr.bytes, kr.written_bytes) == (2 * SIZE, SIZE)
