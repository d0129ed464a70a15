"""The architecture net at v3 (tests/test_architectures.py): the stitched CUDA builds in float16 in
the default suite (but MobileNetV2's and RegNetY's, 20-40 s each: ConvNeXt stands for their
family there), all of them in float32 and float16 in `make test-all`."""

import pytest

from test_architectures import NAMES, SLOW, check_cuda_build


SLOWEST = ("mobilenetv2", "regnety")


@pytest.mark.parametrize("name,dtype", [pytest.param(n, "float16", marks=[SLOW] if n in SLOWEST else []) for n in NAMES]
                         + [pytest.param(n, "float32", marks=SLOW) for n in NAMES])
def test_builds_for_cuda_at_v3(name, dtype):
    check_cuda_build(name, "v3", dtype)
