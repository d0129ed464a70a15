"""Where each group of a partition is called in an emitted module's ``main``: the index every
planning question uses to find a group's PrimFunc."""

from __future__ import annotations

import tvm
from tvm import tirx

from ..codegen import emit
from ..partition.groups import Group


def is_call_tir(value) -> bool:
    """A group's call (opaque ops' own ``call_tir`` s are not groups)."""
    return emit.is_group_call(value)


class GroupCalls:
    """Where each group of a partition is called in an emitted module's ``main``."""

    def __init__(self, mod: tvm.IRModule, groups: list[Group]):
        self.mod, self.groups = mod, groups
        self.call_index: dict[int, int] = {}      # group position -> position among main's call_tir
        for i, g in enumerate(groups):
            if g.opaque is None:
                self.call_index[i] = len(self.call_index)
        self.bindings = [b for blk in mod["main"].body.blocks for b in blk.bindings]
        self.calls = [b.value for b in self.bindings if is_call_tir(b.value)]

    def func(self, i: int) -> tirx.PrimFunc:
        return self.mod[self.calls[self.call_index[i]].args[0]]

    def subprogram_calls(self, subprograms: list[tuple[list[int], str]]) -> list[list[int]]:
        """Each subprogram's groups as positions among main's calls (opaque groups have none)."""
        return [[self.call_index[i] for i in idx if i in self.call_index] for idx, _ in subprograms]
