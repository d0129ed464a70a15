"""Groups: the unit the partitioner draws boundaries around, and the dataflow between them.

A ``Group`` is one future kernel (or an opaque op that runs through TVM); a ``Partition`` is
the model's groups in topological order. The rules that form groups live in ``kernels``, the
rules that join groups into stitched subprograms in ``subprograms``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tvm import te

from ..te import analysis
from ..te.program import OpaqueStage, TEProgram


@dataclass
class Group:
    """One future kernel (or an opaque op): its member stages in topological order."""

    members: list[te.Tensor] = field(default_factory=list)
    opaque: OpaqueStage | None = None
    reason: str = ""           # why this group starts here (the boundary before it)
    row_chain: bool = False    # a row chain (``te.chains``) made one group
    prologue: bool = False     # the first member is applied as the contraction after it loads it
    window_at: int = 0         # a window chain's windowed reduction: its position in members (0: none)
    window_reason: str = ""    # why it joined (the report's groups show it)

    @property
    def anchor(self) -> te.Tensor | None:
        return next((m for m in self.members if analysis.classify(m.op)[0] == analysis.REDUCTION), None)

    @property
    def name(self) -> str:
        if self.opaque is not None:
            return self.opaque.name
        a = self.anchor
        return (a if a is not None else self.members[0]).op.name


@dataclass
class Partition:
    groups: list[Group]


def readers_of(prog: TEProgram) -> dict:
    """op -> the ops (stages, opaque output placeholders) that read it; program outputs too."""
    readers: dict = {}
    for t in prog.stages():
        for x in t.op.input_tensors:
            readers.setdefault(x.op, set()).add(t.op)
    for o in prog.opaque:
        for x in o.inputs.values():
            readers.setdefault(x.op, set()).add(o.outputs[0].op)
    for t in prog.outputs:
        readers.setdefault(t.op, set()).add(None)      # None: read by the caller of main
    return readers


def outputs_of(group: Group, readers: dict) -> list[te.Tensor]:
    """The group's members that something outside the group reads."""
    own = {m.op for m in group.members}
    return [m for m in group.members if readers.get(m.op, set()) - own]


def group_outputs(prog: TEProgram, groups: list[Group]) -> dict[int, list[te.Tensor]]:
    """Per group (by id): its members read by another group, an opaque op or the program."""
    readers = readers_of(prog)
    return {id(g): outputs_of(g, readers) for g in groups}


def group_edges(prog: TEProgram, groups: list[Group]) -> list[list[int]]:
    """The group DAG as ``[producer index, consumer index]`` pairs (indices into ``groups``):
    a consumer group reads a tensor some member (or opaque output) of the producer writes."""
    owner = {}
    for i, g in enumerate(groups):
        for t in (g.opaque.outputs if g.opaque is not None else g.members):
            owner[t.op] = i
    edges = set()
    for j, g in enumerate(groups):
        reads = ([x.op for x in g.opaque.inputs.values()] if g.opaque is not None
                 else [x.op for m in g.members for x in m.op.input_tensors])
        edges.update((owner[op], j) for op in reads if op in owner and owner[op] != j)
    return [list(e) for e in sorted(edges)]
