"""TVM 0.27's FlattenBuffer (IterMapSimplify) gives ``(c - b) // d`` another value when d does not
divide c: the guard finds such indices before they run, and a build that has one refuses."""

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import tirx as T

from souffle_tvm.build import index_guard
from souffle_tvm.build.executable import build
from souffle_tvm.core.targets import make_target
from souffle_tvm.errors import MiscompileError

LLVM = make_target("llvm")


def _flipped(c: int):
    """B[b, t] = A[(c - b) // 8 * 16 + t % 16 + 256]: block b reading its tile last to first (the
    offset keeps TVM's wrong index inside A)."""
    @T.prim_func
    def k(A: T.Buffer((T.int64(4096),), "float32"), B: T.Buffer((T.int64(128), T.int64(256)), "float32")):
        T.func_attr({"global_symbol": "k", "tirx.noalias": True})
        for b in range(T.int64(128)):
            for t in range(T.int64(256)):
                B[b, t] = A[(T.int64(c) - b) // T.int64(8) * T.int64(16) + t % T.int64(16) + T.int64(256)]
    return k


def _run(func) -> np.ndarray:
    lib = tvm.compile(tvm.IRModule({"k": func}), target=LLVM)
    a, b = tvm.runtime.tensor(np.arange(4096, dtype="float32")), tvm.runtime.tensor(np.zeros((128, 256), "float32"))
    lib["k"](a, b)
    return b.numpy()


def _want(c: int) -> np.ndarray:
    b, t = np.arange(128)[:, None], np.arange(256)[None, :]
    return ((c - b) // 8 * 16 + t % 16 + 256).astype("float32")


def test_tvm_still_miscompiles_a_negative_scale_floordiv():
    """The bug the guard exists for. When a TVM upgrade fixes it, this fails: drop the guard's
    table in runtime.emulate and this file's premise (docs/tvm-workarounds.md)."""
    wrong = (_run(_flipped(127)) != _want(127)).any(axis=1)
    assert np.nonzero(wrong)[0].tolist() == [b for b in range(128) if b % 8]     # every b that 8 does not divide
    assert (_run(_flipped(200)) == _want(200)).all()          # 8 divides 200: right


def test_the_guard_finds_the_index_and_the_point_where_it_goes_wrong():
    found = index_guard.hazards(_flipped(127), "k")
    assert len(found) == 1
    (h,) = found
    assert h.buffer == "A" and "127" in h.index and "-8" in h.becomes
    b = h.at["b"]
    assert (127 - b) // 8 != b // -8 + 15                       # the point it names really differs
    assert not index_guard.hazards(_flipped(200), "k")          # no remainder dropped: not a hazard


def test_a_watched_compile_with_the_index_refuses():
    with index_guard.watching() as found:
        tvm.compile(tvm.IRModule({"k": _flipped(127)}), target=LLVM)
    with pytest.raises(MiscompileError, match=r"k: A\[.*would become"):
        index_guard.check(found)
    with index_guard.watching() as found:
        tvm.compile(tvm.IRModule({"k": _flipped(200)}), target=LLVM)
    index_guard.check(found)


def test_the_build_refuses_a_module_with_such_a_kernel():
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([4096], "float32"))
    with bb.function("main", [x]):
        gv = bb.add_func(_flipped(127).with_attr("global_symbol", "flipped"), "flipped")
        with bb.dataflow():
            out = bb.emit_output(relax.call_tir(gv, [x], relax.TensorType([128, 256], "float32")))
        bb.emit_func_output(out)
    with pytest.raises(MiscompileError, match="flipped"):
        build(bb.get(), LLVM)


def test_the_watch_keeps_the_context_it_nests_in():
    with tvm.transform.PassContext(opt_level=3, config={"relax.backend.use_cuda_graph": True}):
        with index_guard.watching():
            inner = tvm.transform.PassContext.current()
            assert inner.opt_level == 3 and bool(inner.config["relax.backend.use_cuda_graph"])
            assert len(inner.instruments) == 1
