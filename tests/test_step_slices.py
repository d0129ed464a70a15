"""Step takes moved to the concat they read from (``transforms.step_slices``): the algebra against
the module as imported (both built by TVM's own pipeline on llvm) and against numpy."""

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import relax as R

from souffle_tvm.core.targets import make_target
from souffle_tvm.frontend.importer import import_onnx
from souffle_tvm.runtime import runner
from souffle_tvm.transforms import step_slices
from souffle_tvm.zoo import lstm

LLVM = make_target("llvm")


def _run(mod, args):
    ex = tvm.compile(mod, target=LLVM)
    vm = relax.VirtualMachine(ex, tvm.cpu())
    return runner.flatten(vm["main"](*[tvm.runtime.tensor(a) for a in args]))


def _ops(mod, name: str) -> int:
    return sum(1 for blk in mod["main"].body.blocks for b in blk.bindings
               if isinstance(b.value, relax.Call) and getattr(b.value.op, "name", "") == name)


def test_a_stacked_lstm_reads_each_step_of_the_layer_below():
    cfg = lstm.LSTMConfig(layers=3, steps=5, hidden=8, features=6, batch=2)
    m = import_onnx(lstm.build(cfg))
    sunk, moved = step_slices.sink(m.mod)
    # every step take of layers 1 and 2 moved to layer 0's and 1's concats; layer 0's takes
    # (from the input's projection, made whole at once) stay
    assert moved == (cfg.layers - 1) * cfg.steps
    assert _ops(sunk, "relax.take") == cfg.steps
    # one whole-sequence projection matmul left (layer 0's), the rest per step
    whole = [b for blk in sunk["main"].body.blocks for b in blk.bindings
             if getattr(getattr(b.value, "op", None), "name", "") == "relax.matmul"
             and int(b.var.ty.shape[0]) == cfg.steps]
    assert len(whole) == 1
    rng = np.random.default_rng(0)
    x = rng.standard_normal((cfg.steps, cfg.batch, cfg.features)).astype(np.float32)
    args = [x] + list(m.params)
    want, got = _run(m.mod, args), _run(sunk, args)
    for w, g in zip(want, got):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


@tvm.script.ir_module
class Rows:
    @R.function
    def main(a: R.Tensor((2, 3), "float32"), b: R.Tensor((1, 3), "float32"), w: R.Tensor((3, 4), "float32"),
             bias: R.Tensor((4,), "float32")):
        with R.dataflow():
            x = R.concat((a, b), axis=0)                 # rows 0-1 from a, row 2 from b
            y = R.add(R.matmul(x, w), bias)
            z = R.sigmoid(y)
            t = R.take(z, R.const(2, "int64"), axis=0)   # b's row
            u = R.take(z, R.const(1, "int64"), axis=0)   # a's second row
            cols = R.take(z, R.const(1, "int64"), axis=1)   # along the matmul's columns: stays
            R.output(t, u, cols)
        return (t, u, cols)


def test_takes_move_through_rows_to_their_piece_and_match_numpy():
    sunk, moved = step_slices.sink(Rows)
    assert moved == 2
    # each moved take is now of its piece (the inputs a and b); the column take did not move,
    # and it keeps the whole matmul alive beside the two one-row ones
    assert _ops(sunk, "relax.take") == 3 and _ops(sunk, "relax.matmul") == 3
    rng = np.random.default_rng(1)
    a, b, w, bias = (rng.standard_normal(s).astype(np.float32) for s in ((2, 3), (1, 3), (3, 4), (4,)))
    t, u, cols = _run(sunk, [a, b, w, bias])
    z = 1 / (1 + np.exp(-(np.concatenate([a, b]) @ w + bias)))
    np.testing.assert_allclose(t, z[2], rtol=1e-5)
    np.testing.assert_allclose(u, z[1], rtol=1e-5)
    np.testing.assert_allclose(cols, z[:, 1], rtol=1e-5)


@tvm.script.ir_module
class Whole:
    @R.function
    def main(x: R.Tensor((4, 3), "float32"), w: R.Tensor((3, 5), "float32")):
        with R.dataflow():
            t = R.take(R.matmul(x, w), R.const(1, "int64"), axis=0)
            R.output(t)
        return t


def test_a_take_from_a_tensor_made_whole_stays():
    """No concat on the way: one matmul over every row is better than one per take."""
    same, moved = step_slices.sink(Whole)
    assert moved == 0 and same is Whole


@pytest.mark.parametrize("broken", ["piece", "offset"])
def test_a_wrong_piece_is_caught(broken, monkeypatch):
    """The numeric check above can fail: taking the wrong concat piece, or the right piece at the
    wrong offset, gives other rows."""
    real = step_slices._Sinker._cls._through

    def wrong(self, x, axis, index):
        out = real(self, x, axis, index)
        v = self._value(x)
        if out is not None and step_slices._op(v) == "relax.concat" and out[0][0] is not None:
            fields = list(v.args[0].fields)
            (f, at, i), rebuild = out
            if broken == "piece" and len(fields) > 1:
                f = fields[(fields.index(f) + 1) % len(fields)]
                i = min(i, int(f.ty.shape[at]) - 1)
            elif broken == "offset" and int(f.ty.shape[at]) > 1:
                i = (i + 1) % int(f.ty.shape[at])
            return (f, at, i), rebuild
        return out

    monkeypatch.setattr(step_slices._Sinker._cls, "_through", wrong)
    sunk, _ = step_slices.sink(Rows)
    rng = np.random.default_rng(1)
    a, b, w, bias = (rng.standard_normal(s).astype(np.float32) for s in ((2, 3), (1, 3), (3, 4), (4,)))
    t, u, _ = _run(sunk, [a, b, w, bias])
    z = 1 / (1 + np.exp(-(np.concatenate([a, b]) @ w + bias)))
    assert not (np.allclose(t, z[2], rtol=1e-5) and np.allclose(u, z[1], rtol=1e-5))
