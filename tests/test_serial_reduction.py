"""SerialReduction (``codegen.rules.serial_reduction``): a reduction of many outputs and few terms
(a depthwise convolution) gets one output per thread with its epilogue in the same thread, where
the latency model predicts that faster than one block per output; a few long rows keep the
cross-thread form. The schedule runs on the CPU through the emulator and matches numpy."""

import numpy as np
import pytest
import tvm
from tvm import te, tirx

from souffle_tvm.codegen import schedule
from souffle_tvm.codegen.rules import SerialReduction
from souffle_tvm.codegen.rules.gemm_tiles import block_count
from souffle_tvm.core.targets import make_target
from souffle_tvm.runtime import emulate
from souffle_tvm.stitch import lower

CUDA = make_target("cuda")
LLVM = make_target("llvm")


def _depthwise(channels=32, size=28, swish=True):
    """3 x 3 depthwise convolution (padding 1) + bias, then swish (x * sigmoid(x), which reads the
    sum twice: no inlining it into the reduction) or nothing."""
    x = te.placeholder((1, channels, size, size), "float32", name="X")
    w = te.placeholder((channels, 1, 3, 3), "float32", name="W")
    b = te.placeholder((channels,), "float32", name="B")
    pad = te.compute((1, channels, size + 2, size + 2),
                     lambda n, c, h, v: tirx.if_then_else(tirx.all(h >= 1, h <= size, v >= 1, v <= size),
                                                          x[n, c, h - 1, v - 1], tirx.const(0.0, "float32")),
                     name="pad")
    ry, rx = te.reduce_axis((0, 3), "ry"), te.reduce_axis((0, 3), "rx")
    conv = te.compute((1, channels, size, size),
                      lambda n, c, h, v: te.sum(pad[n, c, h + ry, v + rx] * w[c, 0, ry, rx], axis=[ry, rx]),
                      name="conv")
    if not swish:
        return te.create_prim_func([x, w, conv]), (x, w)
    y = te.compute(conv.shape, lambda n, c, h, v: (conv[n, c, h, v] + b[c]) *
                   tirx.sigmoid(conv[n, c, h, v] + b[c]), name="swish")
    return te.create_prim_func([x, w, b, y]), (x, w, b)


def _reference(arrays, swish=True):
    x, w = arrays[0], arrays[1]
    n, c, s, _ = x.shape
    pad = np.zeros((n, c, s + 2, s + 2), np.float32)
    pad[:, :, 1:-1, 1:-1] = x
    out = sum(pad[:, :, i:i + s, j:j + s] * w[None, :, 0, i, j, None, None] for i in range(3) for j in range(3))
    if swish:
        out = out + arrays[2][None, :, None, None]
        out = out / (1 + np.exp(-out))
    return out.astype(np.float32)


def _emulated(func, arrays, shape):
    ex = tvm.compile(tvm.IRModule({"k": emulate.emulate_primfunc(func, CUDA, "k")}), target=LLVM)
    out = tvm.runtime.tensor(np.zeros(shape, "float32"))
    ex["k"](*[tvm.runtime.tensor(a) for a in arrays], out)
    return out.numpy()


@pytest.mark.parametrize("swish", [True, False], ids=["with-epilogue", "alone"])
def test_a_depthwise_convolution_gets_one_output_per_thread(swish):
    func, ins = _depthwise(swish=swish)
    done = schedule.schedule_group(func, CUDA, 256)
    assert done.rule == "SerialReduction"
    # one launch region (the epilogue in the summing thread), 32 x 28 x 28 outputs / 256 threads
    (stage,) = lower.lower_stage("g", done.func, CUDA)
    assert stage.num_threads == 256 and block_count(done.func) == -(-32 * 28 * 28 // 256)
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal([int(d) for d in t.shape]).astype("float32") for t in ins]
    got = _emulated(done.func, arrays, (1, 32, 28, 28))
    np.testing.assert_allclose(got, _reference(arrays, swish), rtol=1e-5, atol=1e-5)


def test_few_long_rows_keep_the_cross_thread_reduction():
    """LayerNorm's row sum at BERT-base's shape (384 rows of 768): 2 blocks of 256 threads each
    summing 768 terms would leave the GPU idle; the model keeps one block per row."""
    x = te.placeholder((384, 768), "float32", name="X")
    k = te.reduce_axis((0, 768), "k")
    s = te.compute((384,), lambda i: te.sum(x[i, k], axis=k), name="S")
    with CUDA:
        assert SerialReduction(256).apply(te.create_prim_func([x, s]), CUDA, False) is None


def _short_rows(consumer):
    x = te.placeholder((4096, 8), "float32", name="X")
    k = te.reduce_axis((0, 8), "k")
    s = te.compute((4096,), lambda i: te.sum(x[i, k], axis=k), name="S")
    return te.create_prim_func([x, consumer(x, s)])


def test_a_consumer_of_its_own_rows_sum_runs_in_the_summing_thread():
    """y[i, j] = x[i, j] - sum_k x[i, k]: the thread that sums row i also writes that row."""
    func = _short_rows(lambda x, s: te.compute((4096, 8), lambda i, j: x[i, j] - s[i], name="Y"))
    done = schedule.schedule_group(func, CUDA, 256)
    assert done.rule == "SerialReduction" and len(lower.lower_stage("g", done.func, CUDA)) == 1
    arr = np.random.default_rng(1).standard_normal((4096, 8)).astype("float32")
    np.testing.assert_allclose(_emulated(done.func, [arr], (4096, 8)), arr - arr.sum(1, keepdims=True),
                               rtol=1e-5, atol=1e-5)


def test_a_consumer_of_another_threads_sum_is_not_this_form():
    """y[i] = s[i] + s[i + 1] needs the next thread's sum: the rule does not apply."""
    func = _short_rows(lambda x, s: te.compute((4095,), lambda i: s[i] + s[i + 1], name="Y"))
    with CUDA:
        assert SerialReduction(256).apply(func, CUDA, False) is None


def test_a_sum_that_is_also_an_output_stays_in_global_memory():
    """A group whose sum is an output too (the sum and x - sum): written where its parameter is."""
    x = te.placeholder((4096, 8), "float32", name="X")
    k = te.reduce_axis((0, 8), "k")
    s = te.compute((4096,), lambda i: te.sum(x[i, k], axis=k), name="S")
    y = te.compute((4096, 8), lambda i, j: x[i, j] - s[i], name="Y")
    done = schedule.schedule_group(te.create_prim_func([x, s, y]), CUDA, 256)
    assert done.rule == "SerialReduction" and not done.notes
    arr = np.random.default_rng(2).standard_normal((4096, 8)).astype("float32")
    ex = tvm.compile(tvm.IRModule({"k": emulate.emulate_primfunc(done.func, CUDA, "k")}), target=LLVM)
    outs = [tvm.runtime.tensor(np.zeros(shape, "float32")) for shape in ((4096,), (4096, 8))]
    ex["k"](tvm.runtime.tensor(arr), *outs)
    np.testing.assert_allclose(outs[0].numpy(), arr.sum(1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(outs[1].numpy(), arr - arr.sum(1, keepdims=True), rtol=1e-5, atol=1e-5)
