"""Every small zoo model's CUDA build compiles with nvcc for sm_80 and sm_90."""

import pytest

from conftest import ZOO, needs_nvcc
from souffle_tvm.api import compile as compile_model


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("name", ZOO)
def test_small_model_cuda_build_compiles_with_nvcc(name, arch):
    compiled = compile_model(name, "cuda", arch=arch, small=True)
    r = compiled.report
    assert r.nvcc["available"], r.nvcc
    assert compiled.cuda_source.count("__global__") >= r.distinct_kernels
    assert r.distinct_kernels == len({k.name for k in r.kernels})
    for k in r.kernels:
        assert k.registers is not None and 0 < k.registers <= 255, k
        assert k.spill_bytes == 0, f"{k.name} spills {k.spill_bytes} bytes"
        assert all(g >= 1 for g in k.grid) and 1 <= k.block[0] * k.block[1] * k.block[2] <= 1024
    assert r.launches >= r.distinct_kernels


@needs_nvcc
@pytest.mark.parametrize("name", ZOO)
def test_small_model_stitched_build_compiles_and_fits(name):
    """``--fusion souffle --level v3``: cooperative kernels that ptxas accepts without spills,
    each passing the static check, with grids that can be co-resident."""
    compiled = compile_model(name, "cuda", "souffle", small=True, level="v3")
    r = compiled.report
    coop = [k for k in r.kernels if k.cooperative]
    assert coop and r.nvcc["available"]
    for k in r.kernels:
        assert k.spill_bytes == 0, f"{k.name} spills {k.spill_bytes} bytes"
    for k in coop:
        assert k.grid_syncs and k.grid[0] <= k.max_coresident
