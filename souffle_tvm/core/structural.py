"""A memo keyed by TVM IR up to structural equality (hash buckets, equality within a bucket)."""

from __future__ import annotations

from typing import Callable, Hashable

import tvm_ffi


class ByStructure:
    """``memo(node, make, key)``: the value kept for a node structurally equal to ``node``
    under ``key`` (settings that also decide it), else ``make()``, kept."""

    def __init__(self):
        self._buckets: dict = {}

    def __call__(self, node, make: Callable[[], object], key: Hashable = ()):
        bucket = self._buckets.setdefault((key, tvm_ffi.structural_hash(node)), [])
        for seen, value in bucket:
            if tvm_ffi.structural_equal(seen, node):
                return value
        value = make()
        bucket.append((node, value))
        return value
