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

from typing import Hashable, NamedTuple


class Waves(NamedTuple):
    order: list[int]       # the stages' new order (indices into the order given)
    lanes: list[int]       # per stage in the new order: its lane


def levels(args: list[list[Hashable]], access: list[tuple[list[bool], list[bool]]]) -> list[int]:
    """Per stage, its wave: 0 when it depends on no earlier stage, else one more than the latest
    earlier stage whose output it reads (read after write) or whose tensor it overwrites (write
    after read or write). Stages of one wave therefore share no tensor that one of them writes."""
    written: dict = {}      # key -> the latest wave that wrote it
    touched: dict = {}      # key -> the latest wave that read or wrote it
    out = []
    for keys, (reads, writes) in zip(args, access):
        wave = 0
        for k, r, w in zip(keys, reads, writes):
            if r and k in written:
                wave = max(wave, written[k] + 1)
            if w and k in touched:
                wave = max(wave, touched[k] + 1)
        for k, r, w in zip(keys, reads, writes):
            if w:
                written[k] = max(written.get(k, 0), wave)
            if r or w:
                touched[k] = max(touched.get(k, 0), wave)
        out.append(wave)
    return out


def schedule(args: list[list[Hashable]], access: list[tuple[list[bool], list[bool]]], blocks: list[int],
             grid: int) -> Waves:
    """The stages ordered by wave (stable within one), and their lanes: in each wave the stages
    one after another on the grid, each starting where the previous one's blocks end (modulo
    the grid)."""
    wave = levels(args, access)
    order = sorted(range(len(wave)), key=lambda i: (wave[i], i))
    lanes, start, at = [], None, 0
    for i in order:
        if wave[i] != start:
            start, at = wave[i], 0
        lanes.append(at % grid)
        at += blocks[i]
    return Waves(order, lanes)


def count(waves: list[int]) -> int:
    """How many waves ``levels`` found."""
    return max(waves, default=-1) + 1
