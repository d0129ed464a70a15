"""Row chains: a contraction whose output rows are consumed whole, on chip, by one block.

Attention is the chain the paper's authors fused by hand: ``S = Q Kᵀ`` writes score rows,
softmax reduces each row twice (max, then the sum of exponentials) and normalises it, and
``P V`` contracts each row again. Nothing reads a score row but the row's own later stages,
so a block that computes whole rows ``r`` of ``S`` can finish them through ``P V`` without
any other block's data: the scores never need to leave the chip.

``row_chains`` finds such chains from index expressions alone (never operator names):

* the **head** is a contraction writing ``[*rows, L]``;
* each following stage, in program order, reads the chain's tensors only *row-locally*: its
  leading axes are ``rows`` and it reads a chain tensor at ``(*rows, j)``, where ``j`` is its
  own last axis (an element-wise stage over ``[*rows, L]`` or ``rows``) or its summed axis
  (a reduction of whole rows of ``L`` to ``rows``);
* the **tail** is a contraction over the row, ``[*rows, N]`` summing ``L``: the first stage
  that reads the chain and writes something other than ``[*rows, L]`` or ``rows``;
* at least one stage between reduces whole rows (else the chain is a GEMM → GEMM pair, whose
  rows are better split than held: nothing waits for a whole row);
* no tensor of the chain but the tail's is read after it, and ``L`` is short enough that a
  few rows of the two full-length tensors a block keeps fit in shared memory (``MAX_ROW_BYTES``).

A chain is a candidate: the partitioner makes it one kernel group (``partition.kernels``),
two-phase splitting leaves its reductions whole (``transforms.two_phase``), and its schedule
rule (``codegen.rules.row_chain``) holds the rows in shared memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import te

from . import analysis, rewrite as te_rewrite
from ..cost import tir_stats
from ..core.geometry import STATIC_SHARED_LIMIT

MIN_ROWS = 8        # rows a block holds at least (the schedule rule's smallest row tile)
# the longest row: MIN_ROWS rows of the head's output and of the tail's operand in shared memory
MAX_ROW_BYTES = STATIC_SHARED_LIMIT // (2 * MIN_ROWS)


@dataclass(frozen=True)
class RowChain:
    """A chain's stages in program order (head first, tail last), its row space and row length."""
    stages: tuple[te.Tensor, ...]
    rows: tuple[int, ...]
    length: int

    @property
    def head(self) -> te.Tensor:
        return self.stages[0]

    @property
    def tail(self) -> te.Tensor:
        return self.stages[-1]

    def describe(self) -> str:
        return (f"row chain {self.head.op.name} -> {self.tail.op.name}: {len(self.stages)} stages over rows "
                f"{'x'.join(map(str, self.rows))} of {self.length}, each row held whole by one block")


def _shape(t: te.Tensor) -> tuple[int, ...]:
    return tuple(int(s) for s in t.shape)


def _is_contraction(op) -> bool:
    return isinstance(op, te.ComputeOp) and analysis.classify(op)[1] == "contraction"


def _reads_rows(op: te.ComputeOp, members: set, rows: int) -> bool | None:
    """Whether every read of a chain tensor in ``op`` is row-local (None: it reads none).
    A full-length tensor is read at ``(*rows, j)``, ``j`` the op's last axis or its summed
    axis; a per-row tensor (a reduction's result) at ``rows``."""
    axes = [ax.var for ax in op.axis]
    last = [axes[-1]] if len(axes) > rows else []
    summed = [rv.var for rv in op.reduce_axis]
    read = False
    for t, idx in te_rewrite.loads(op.body[0]):
        if t.op not in members:
            continue
        read = True
        if len(idx) < rows or not all(_is_var(i, a) for i, a in zip(idx[:rows], axes[:rows])):
            return False
        rest = idx[rows:]
        if rest and not (len(rest) == 1 and any(_is_var(rest[0], v) for v in last + summed)):
            return False
    return read if read else None


def _is_var(e, v) -> bool:
    return isinstance(e, type(v)) and e.same_as(v)


def _chain_from(stages: list[te.Tensor], start: int, readers: dict) -> RowChain | None:
    head = stages[start]
    shape = _shape(head)
    if len(shape) < 2 or not _is_contraction(head.op):
        return None
    rows, length = shape[:-1], shape[-1]
    if length * max(1, tir_stats.dtype_bytes(head.dtype)) > MAX_ROW_BYTES:
        return None
    members, chain = {head.op}, [head]
    for t in stages[start + 1:]:
        op = t.op
        if not isinstance(op, te.ComputeOp):
            return None
        reads = _reads_rows(op, members, len(rows))
        if not reads:             # None: a stage between that is not the chain's (not contiguous)
            return None
        out = _shape(t)
        summed = [int(rv.dom.extent) for rv in op.reduce_axis]
        if out[:len(rows)] != rows:
            return None
        if out == rows + (length,) and not summed or out == rows and summed == [length]:
            members.add(op)
            chain.append(t)
            continue
        if len(out) == len(rows) + 1 and summed == [length] and _is_contraction(op) and \
                any(m.op.reduce_axis for m in chain[1:]):
            chain.append(t)       # the tail
            inner = {m.op for m in chain[:-1]}
            if any(r not in inner | {op} for m in chain[:-1] for r in readers.get(m.op, ())):
                return None       # a row tensor is read after the chain: it would leave the chip
            return RowChain(tuple(chain), rows, length)
        return None
    return None


def row_chains(stages: list[te.Tensor], readers: dict) -> list[RowChain]:
    """The row chains of a program's stages (topological order); ``readers``: op -> the ops
    that read it (``partition.groups.readers_of``'s form; program outputs count as readers)."""
    out, i = [], 0
    while i < len(stages):
        chain = _chain_from(stages, i, readers)
        if chain is None:
            i += 1
            continue
        out.append(chain)
        i += len(chain.stages)
    return out
