"""Shared memory over the 48 KB a CUDA kernel may declare statically goes dynamic (issue 33, item 1a).

ptxas refuses a kernel whose static ``__shared__`` arrays pass 48 KB; the build
(``build.dynamic_shared``, first in the TIR pipeline) moves such a kernel's shared buffers to
``shared.dyn``, which TVM merges into one ``extern __shared__`` array and opts in to at launch.
"""

from __future__ import annotations

import re

import tvm
from tvm import s_tir, te

from conftest import needs_nvcc
from souffle_tvm.build import executable, ptxas
from souffle_tvm.cost import estimate, hardware
from souffle_tvm.core.geometry import STATIC_SHARED_LIMIT
from souffle_tvm.core.targets import make_target
from souffle_tvm.partition import subprograms
from souffle_tvm.pipeline.building import cuda_source


def staged_rows(rows: int, width: int = 8192) -> tvm.tirx.PrimFunc:
    """y[i, j] = x[i, j] + x[i, width-1-j]: each block stages ``rows`` whole rows of x in shared
    memory (``rows * width * 4`` bytes), as a convolution stages its input window."""
    x = te.placeholder((64, width), "float32", name="x")
    y = te.compute((64, width), lambda i, j: x[i, j] + x[i, width - 1 - j], name="y")
    sch = s_tir.Schedule(te.create_prim_func([x, y]))
    blk = sch.get_sblock("y")
    i, j = sch.get_loops(blk)
    io, ii = sch.split(i, [None, rows])
    jo, ji = sch.split(j, [None, 256])
    sch.reorder(io, ii, jo, ji)
    sch.bind(io, "blockIdx.x")
    sch.bind(ji, "threadIdx.x")
    cache = sch.cache_read(blk, 0, "shared")
    sch.compute_at(cache, io)
    _, inner = sch.split(sch.fuse(*sch.get_loops(cache)[1:]), [None, 256])
    sch.bind(inner, "threadIdx.x")
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def build(func: tvm.tirx.PrimFunc) -> tuple[str, list]:
    """The CUDA source and the recorded device kernels of ``func`` built by the project's TIR pipeline."""
    with executable.recording() as kernels:
        ex = tvm.compile(tvm.IRModule({"staged": func.with_attr("global_symbol", "staged")}), make_target("cuda"),
                         tir_pipeline=executable.TIR_PIPELINE)
    return cuda_source(ex), list(kernels)


def static_arrays(source: str) -> list[str]:
    return re.findall(r"__shared__ (?:alignas\(\d+\) |__align__\(\d+\) )?\w+ \w+\[\d+\]", source)


@needs_nvcc
def test_shared_over_48kb_goes_dynamic_and_ptxas_accepts_it():
    source, kernels = build(staged_rows(2))         # 2 rows x 8192 floats: 64 KB per block
    assert not static_arrays(source), static_arrays(source)
    assert "extern __shared__" in source
    assert [k.dyn_shared_bytes for k in kernels] == [64 * 1024]
    figures = ptxas.measure(source, "sm_90")        # before: "uses too much shared data" from ptxas
    assert figures and all(f.spill_bytes == 0 for f in figures.values())


def test_shared_under_48kb_stays_static():
    source, kernels = build(staged_rows(1))         # 32 KB: no reason to opt in
    assert len(static_arrays(source)) == 1 and "extern __shared__" not in source
    assert [k.dyn_shared_bytes for k in kernels] == [0]


def test_estimate_knows_the_static_limit():
    gpu = hardware.GPUS["h200"]
    under = estimate.Estimate(64, STATIC_SHARED_LIMIT, False)
    over = estimate.Estimate(64, STATIC_SHARED_LIMIT + 4096, False)
    assert not under.dynamic_shared and over.dynamic_shared
    # dynamic above 48 KB, so a kernel fits up to the opt-in size, and no further
    facts = subprograms.GroupFacts([None, None], stages=[[over], [estimate.Estimate(64, 1024, False)]])
    assert subprograms.why_over_budget(facts, [0, 1], gpu) is None
    facts.stages[1] = [estimate.Estimate(64, gpu.smem_per_block_optin + 1, False)]
    why = subprograms.why_over_budget(facts, [0, 1], gpu)
    assert why is not None and "opt in" in why
