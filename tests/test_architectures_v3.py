"""The architecture net at v3 (tests/test_architectures.py): every architecture's stitched CUDA
build in float16 in the default suite, in float32 in `make test-all`."""

import pytest

from test_architectures import NAMES, SLOW, check_cuda_build


@pytest.mark.parametrize("name,dtype", [(n, "float16") for n in NAMES] + [pytest.param(n, "float32", marks=SLOW)
                                                                          for n in NAMES])
def test_builds_for_cuda_at_v3(name, dtype):
    check_cuda_build(name, "v3", dtype)
