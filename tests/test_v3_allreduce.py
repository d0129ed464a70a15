"""Cross-thread reductions in stitched kernels (issue 18, class 2).

A BERT export with hidden size 256 gets LayerNorm/softmax rows scheduled as cross-thread
reductions (``tvm_thread_allreduce`` over the stage's threadIdx.x). Stitched at v3, the stage's
thread index became an expression of the kernel's (``threadIdx_x % 256``) and TVM's
LowerThreadAllreduce failed: "Not all reduce index are presented in the context". A reduction
over the stage's one thread index, as wide as the kernel, now reduces over the kernel's own
threadIdx.x; a reduction over part of a stage's threads cannot be stitched (the partitioner is
told so, and keeps that stage in a kernel of its own). Stage names made by the two-phase
transform (``T_add_sum#1``) no longer reach the CUDA source either.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import tvm
from tvm import s_tir, te

import torch_models as tm
from conftest import emulated_comparisons, needs_nvcc
from souffle_tvm.core.targets import make_target
from souffle_tvm.frontend.importer import import_onnx
from souffle_tvm.pipeline import results
from souffle_tvm.pipeline.options import Options
from souffle_tvm.stitch import kernel_ir, lower

ROOT = Path(__file__).resolve().parent.parent
CUDA = make_target("cuda")


@pytest.fixture(scope="module")
def bert256(tmp_path_factory) -> str:
    """BERT (tests/torch_models.Bert) at hidden size 256, one layer, 64 tokens, legacy export
    (at 16 tokens TVM's simplifier happened to turn the stitched thread index back into the
    kernel's, and the build passed before the fix)."""
    path = str(tmp_path_factory.mktemp("bert256") / "bert256.onnx")
    torch.manual_seed(0)
    model = tm.Bert(dim=256, heads=4, layers=1, max_len=64).eval()
    args = tuple(torch.from_numpy(a) for a in tm.example_inputs("bert", batch=1, seq=64).values())
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(model, args, path, input_names=list(tm.SPECS["bert"].inputs),
                          output_names=["hidden", "pooled"], opset_version=17, dynamo=False)
    return path


def _row_sum(threads_x: int, rows_per_block: int) -> tvm.tirx.PrimFunc:
    """sum over 256 columns of 64 rows, the columns over ``threads_x`` threads (cross-thread)
    and ``rows_per_block`` rows over threadIdx.y."""
    a = te.placeholder((64, 256), name="A")
    k = te.reduce_axis((0, 256), name="k")
    s = te.compute((64,), lambda i: te.sum(a[i, k], axis=k), name="S")
    sch = s_tir.Schedule(te.create_prim_func([a, s]))
    i, kk = sch.get_loops(sch.get_sblock("S"))
    io_, ii = sch.split(i, [None, rows_per_block])
    ko, ki = sch.split(kk, [None, threads_x])
    sch.bind(io_, "blockIdx.x")
    sch.bind(ii, "threadIdx.y")
    sch.bind(ki, "threadIdx.x")
    return sch.mod["main"]


def test_a_reduction_over_the_whole_block_is_stitchable_one_over_part_of_it_is_not():
    whole, part = _row_sum(256, 1), _row_sum(32, 8)
    for f in (whole, part):
        (st,) = lower.lower_stage("s", f, CUDA)
        assert st.num_threads == 256 and kernel_ir.allreduce_threads(st.body)
    assert lower.why_not_stitchable(whole, CUDA, 256) is None
    why = lower.why_not_stitchable(part, CUDA, 256)
    assert why is not None and "cross-thread reduction" in why, why


@needs_nvcc
def test_bert256_builds_at_v3_for_cuda_through_the_cli(bert256, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "souffle_tvm.cli", "-q", "compile", bert256, "--target", "cuda",
                           "--arch", "sm_90", "--fusion", "souffle", "--level", "v3", "--report", "r.json"],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["nvcc"]["available"] and not report.get("fallback")
    coop = [k for k in report["kernels"] if k["cooperative"]]
    assert coop and all(k["spill_bytes"] == 0 for k in report["kernels"])


def test_bert256_stitched_kernels_reduce_across_threads_and_match_when_emulated(bert256):
    m = import_onnx(bert256)
    souffle = results.run(m.mod, CUDA, m.params, Options(level="v3"))
    assert souffle.stitched and all(k.safety.ok for k in souffle.stitched)
    stitched = [souffle.mod[k.function or k.name] for k in souffle.stitched]
    assert any(kernel_ir.allreduce_threads(f.body) for f in stitched), "no cross-thread reduction was stitched"
    for c in emulated_comparisons(m, souffle.mod, souffle.params):
        assert c.finite and c.rel_l2 < 1e-5, c
