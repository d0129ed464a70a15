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
keeps the wave order only where it needs fewer grid syncs than the order it was given, and
writes out no more stage loops than the partitioner's group cap (``kernel.stitch``).

A wave kernel's steady waves, and the ramp waves beside them under guards, are one loop
(``ramps``): the full 10 x 100 LSTM is one kernel of 110 grid syncs that writes out 109 stage
loops. Not yet: dependency counters instead of the grid syncs (a layer waiting only for the
cells it reads).
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
    given order on one lane. A strand takes the lane of the strand it reads most from where
    those blocks are free in its wave (``_preferred``), else starts where the wave's strands
    placed so far end (modulo the grid)."""
    wave = levels(args, access, crosses)
    strand = list(range(len(wave)))

    def root(i: int) -> int:
        while strand[i] != i:
            strand[i] = strand[strand[i]]
            i = strand[i]
        return i

    writer: dict = {}
    feeds: dict = {}        # stage -> {producer stage: keys it reads from it}
    for i, (keys, (reads, writes)) in enumerate(zip(args, access)):
        for k, r, w in zip(keys, reads, writes):
            if r and k in writer:
                feeds.setdefault(i, {}).setdefault(writer[k], 0)
                feeds[i][writer[k]] += 1
                if wave[writer[k]] == wave[i]:
                    strand[root(i)] = root(writer[k])
        for k, w in zip(keys, writes):
            if w:
                writer[k] = i
    first: dict = {}
    for i in range(len(wave)):
        first.setdefault(root(i), i)
    order = sorted(range(len(wave)), key=lambda i: (wave[i], first[root(i)], i))
    width: dict = {}
    members: dict = {}
    for i in order:
        width[root(i)] = max(width.get(root(i), 0), blocks[i])
        members.setdefault(root(i), []).append(i)
    lane_of: dict = {}
    taken: list = []        # this wave's placed strands: (lane, width)
    current = None
    for i in order:
        r = root(i)
        if wave[i] != current:
            current, taken = wave[i], []
        if r not in lane_of:
            lane_of[r] = _place(_preferred(r, members[r], feeds, root, lane_of),
                                width[r], taken, grid)
            taken.append((lane_of[r], width[r]))
    return Waves(order, [lane_of[root(i)] for i in order])


def _preferred(strand: int, stages: list[int], feeds: dict, root: Callable[[int], int], lane_of: dict) -> list[int]:
    """The lanes of the strands ``strand`` reads from, most keys first: where a chain continues
    on the blocks it ran on, its reads of itself stay block-local (an LSTM layer's c and h)."""
    count: dict = {}
    for i in stages:
        for j, n in feeds.get(i, {}).items():
            if root(j) != strand and root(j) in lane_of:
                count[lane_of[root(j)]] = count.get(lane_of[root(j)], 0) + n
    return sorted(count, key=lambda lane: -count[lane])


def _place(preferred: list[int], width: int, taken: list, grid: int) -> int:
    """The first preferred lane whose blocks no strand of the wave has taken, else the first lane
    after them all where that is free. Where no lane is free (the wave's strands are wider than
    the grid together), the strand keeps the lane it reads most from: its blocks are shared
    either way, and a chain that stays on its blocks wave after wave keeps its state there and
    runs the same code in every wave (``ramps``)."""
    def free(lane: int) -> bool:
        return lane + width <= grid and all(lane + width <= a or a + w <= lane for a, w in taken)
    for lane in preferred:
        if free(lane):
            return lane
    end = max((a + w for a, w in taken), default=0) % grid
    return end if free(end) or not preferred else preferred[0]
