"""Waves: the stages of a stitched kernel that depend on nothing between them run side by side,
each on its own blocks, behind one barrier.

The partitioner hands a kernel its stages in a topological order of the graph, which for a
stacked recurrence is layer after layer: cell (layer l, step t) reads only (l, t-1) and
(l-1, t), yet every cell waits at its own grid syncs, one layer after the other. Ordered by
*wave* instead (one more than the latest earlier stage it depends on), all cells with
l + t = w fall in the same waves: a 10-layer, 100-step LSTM needs 109 waves of barriers, not
1000 (the paper's LSTM kernel, derived here from the stages' accesses alone).

Stages of one wave share no tensor one writes, so no barrier orders them; each gets a *lane*,
the block its virtual block 0 runs on, after the blocks of the wave's earlier stages
(``kernel_ir.lane_block`` rotates the block index). Stages of one wave then run on different
blocks at once rather than one after another on the first blocks of the grid. A dependence
between stages on different lanes is a cross-block one (``dependence.barrier_needed`` keeps
its grid sync), so lanes never make a kernel unsafe, only sometimes cost a sync; the stitcher
keeps the wave order only where it needs fewer grid syncs than the order it was given.
"""

from __future__ import annotations

from typing import Callable, Hashable, NamedTuple


class Waves(NamedTuple):
    order: list[int]       # the stages' new order (indices into the order given)
    lanes: list[int]       # per stage in the new order: its lane


def levels(args: list[list[Hashable]], access: list[tuple[list[bool], list[bool]]],
           crosses: Callable[[int, int, Hashable], bool] = lambda j, i, k: True) -> list[int]:
    """Per stage, its wave: 0 when it depends on no earlier stage, else the latest wave among
    the earlier stages it depends on, one more where that dependence needs a grid sync: a read
    of what another block wrote (``crosses(writer, reader, key)``), or a write after a read or
    write. A stage that reads only what the same block of its producer wrote stays in the
    producer's wave, after it on the same lane (``schedule``)."""
    writer: dict = {}       # key -> the latest stage that wrote it
    touched: dict = {}      # key -> the latest wave that read or wrote it
    out: list[int] = []
    for i, (keys, (reads, writes)) in enumerate(zip(args, access)):
        wave = 0
        for k, r, w in zip(keys, reads, writes):
            if r and k in writer:
                j = writer[k]
                wave = max(wave, out[j] + (1 if crosses(j, i, k) else 0))
            if w and k in touched:
                wave = max(wave, touched[k] + 1)
        for k, r, w in zip(keys, reads, writes):
            if w:
                writer[k] = i
            if r or w:
                touched[k] = max(touched.get(k, 0), wave)
        out.append(wave)
    return out


def schedule(args: list[list[Hashable]], access: list[tuple[list[bool], list[bool]]], blocks: list[int],
             grid: int, crosses: Callable[[int, int, Hashable], bool] = lambda j, i, k: True) -> Waves:
    """The stages ordered by wave, and their lanes. In a wave, the stages linked by block-local
    dependences form a *strand* (one chain's run between grid syncs), kept together in their
    given order on one lane; the strands one after another on the grid, each starting where the
    previous one's blocks end (modulo the grid)."""
    wave = levels(args, access, crosses)
    strand = list(range(len(wave)))

    def root(i: int) -> int:
        while strand[i] != i:
            strand[i] = strand[strand[i]]
            i = strand[i]
        return i

    writer: dict = {}
    for i, (keys, (reads, writes)) in enumerate(zip(args, access)):
        for k, r, w in zip(keys, reads, writes):
            if r and k in writer and wave[writer[k]] == wave[i]:
                strand[root(i)] = root(writer[k])
        for k, w in zip(keys, writes):
            if w:
                writer[k] = i
    first = {}
    for i in range(len(wave)):
        first.setdefault(root(i), i)
    order = sorted(range(len(wave)), key=lambda i: (wave[i], first[root(i)], i))
    width: dict = {}
    for i in order:
        width[root(i)] = max(width.get(root(i), 0), blocks[i])
    lanes, lane_of, at, current = [], {}, 0, None
    for i in order:
        if wave[i] != current:
            current, at = wave[i], 0
        if root(i) not in lane_of:
            lane_of[root(i)], at = at % grid, at + width[root(i)]
        lanes.append(lane_of[root(i)])
    return Waves(order, lanes)
