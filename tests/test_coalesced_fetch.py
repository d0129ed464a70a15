"""The SIMT GEMM's operand copies into shared memory (``codegen.rules.coalesced_fetch``): a warp's
lanes read consecutive addresses of the operand in global memory, whichever axis it is
contiguous on and however long the K step, counted by execution in the GPU emulator; the
products match numpy in either layout, with and without vector loads."""

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import s_tir, te, tirx

from souffle_tvm.codegen.rules import StitchedMatmul
from souffle_tvm.core.targets import make_target
from souffle_tvm.runtime import emulate, traffic

CUDA = make_target("cuda")
LLVM = make_target("llvm")


def _gemm(m: int, n: int, k: int, a_rows_first: bool = True, b_rows_first: bool = True):
    """C[m, n] = sum_r A . B with A stored [m, k] (or [k, m]) and B stored [k, n] (or [n, k])."""
    a = te.placeholder((m, k) if a_rows_first else (k, m), name="A")
    b = te.placeholder((k, n) if b_rows_first else (n, k), name="B")
    r = te.reduce_axis((0, k), name="r")
    c = te.compute((m, n), lambda i, j: te.sum((a[i, r] if a_rows_first else a[r, i]) *
                                               (b[r, j] if b_rows_first else b[j, r]), axis=r), name="C")
    return te.create_prim_func([a, b, c])


def _scheduled(func, k_tile: int, micro: int = 4):
    with CUDA:
        return StitchedMatmul(k_tile=k_tile, micro=micro).apply(func, CUDA, False).mod["main"] \
            .with_attr("global_symbol", "k")


def _reads(func, a, b):
    """The counted loads of A and B, and the product."""
    out = np.full((a.shape[0], b.shape[1] if b.shape[0] == a.shape[1] else b.shape[0]), np.nan, "float32")
    outs, launches = traffic.Counting(tvm.IRModule({"k": func}), CUDA).run([a, b, out])
    (launch,) = launches.values()
    assert launch.sectors_exact
    return {buf.name: buf for buf in launch.buffers}, outs[2]


@pytest.mark.parametrize("k_tile", [16, 64])
@pytest.mark.parametrize("b_rows_first", [True, False], ids=["B[K,N]", "B[N,K]"])
def test_every_operand_load_of_a_warp_touches_eight_sectors(k_tile, b_rows_first):
    """64 x 64 x 256, one 64 x 64 tile (4 x 4 per thread): each K step copies a 64 x k_tile slice
    of each operand, 64 floats (two per lane) a warp request: 256 bytes, eight sectors, whether
    the operand is contiguous along K (A; B stored [N, K]) or along its columns (B stored [K, N],
    an ONNX MatMul's weight). dlight's copy put the serial loop inside the thread index: lanes
    sat 16 bytes apart at a 16-term step (16 sectors a request of an operand contiguous along K)
    and 64 bytes apart at a 64-term one (32). (Its lanes along K of B[K, N] still filled whole
    sectors, 8 columns of 4 rows a request, but as two scalar loads a lane.)"""
    m = n = 64
    k = 256
    rng = np.random.default_rng(k_tile)
    a = rng.standard_normal((m, k)).astype("float32")
    b = rng.standard_normal((k, n) if b_rows_first else (n, k)).astype("float32")
    reads, c = _reads(_scheduled(_gemm(m, n, k, b_rows_first=b_rows_first), k_tile), a, b)
    for name in ("A", "B"):
        assert reads[name].read_requests == m * k // 64            # 256: every element read once
        assert reads[name].read_sectors == 8 * reads[name].read_requests
    want = a.astype("float64") @ (b if b_rows_first else b.T).astype("float64")
    assert np.linalg.norm(c - want) / np.linalg.norm(want) < 1e-5


def _copy_vector_widths(func) -> dict[str, int]:
    """Per shared-memory copy block, the width of the vectorized loop around it (1: none)."""
    widths = {}

    def visit(loop):
        if loop.kind == tirx.ForKind.VECTORIZED:
            names = []
            tvm_ffi.structural_walk(loop.body, (s_tir.SBlock, lambda blk: names.append(blk.name_hint)))
            for name in names:
                if name.endswith("_shared"):
                    widths[name] = int(loop.extent)
    tvm_ffi.structural_walk(func.body, (tirx.For, visit))
    return widths


@pytest.mark.parametrize("m,n,k", [(49, 70, 200), (40, 49, 96)], ids=["even-rows", "odd-rows"])
def test_operands_contiguous_along_their_rows_or_columns_compute_the_same_product(m, n, k):
    """A stored [K, M] (an NCHW 1x1 convolution's input) and B stored [K, N]: both staged K-major,
    ragged M, N and K. Where B's rows are an odd 49 floats long, a two-float load along them
    would be misaligned every other row: that copy is not vectorized, the others are."""
    func = _scheduled(_gemm(m, n, k, a_rows_first=False), 64, micro=2)
    widths = _copy_vector_widths(func)
    assert widths.get("A_reindex_pad_shared", widths.get("A_reindex_shared", 1)) == (2 if m % 2 == 0 else 1)
    assert widths.get("B_reindex_pad_shared", widths.get("B_reindex_shared", 1)) == (2 if n % 2 == 0 else 1)
    rng = np.random.default_rng(m + n + k)
    a = rng.standard_normal((k, m)).astype("float32")
    b = rng.standard_normal((k, n)).astype("float32")
    ex = tvm.compile(tvm.IRModule({"k": emulate.emulate_primfunc(func, CUDA, "k")}), target=LLVM)
    out = tvm.runtime.tensor(np.full((m, n), np.nan, "float32"))
    ex["k"](tvm.runtime.tensor(a), tvm.runtime.tensor(b), out)
    want = a.T.astype("float64") @ b.astype("float64")
    assert np.linalg.norm(out.numpy() - want) / np.linalg.norm(want) < 1e-5
