"""Resident inputs: a weight that a stitched kernel's stages read again and again is loaded into
each block's shared memory once, and read there from then on.

An LSTM layer's recurrent weights are read by the layer's recurrent product at every time step:
as separate kernels (and as stitched stages reading global memory) that is the whole matrix
once a step, about 93% of the full LSTM's traffic. In a stitched kernel a stage with no more
virtual blocks than the grid has blocks runs virtual block ``b`` on block ``b`` and nowhere
else, in every stage of that size. So when every stage reading an input has the same block
count, at most the grid, and its loads for virtual block ``vb`` stay in one box whose corner
moves only with ``vb`` (``dependence.read_box``), block ``b`` can copy box ``b`` into its
shared memory once and every reader can read the copy instead (the persistent-RNN form:
the layer's weights split across the co-resident blocks).

* The copy (the *fill*) runs inside the first reader's stage loop, before its body, with a
  block barrier between, so that the fill's global reads are that stage's own (the traffic
  counter and the report charge them there) and the static check sees them as a stage's.
* The later readers read the copy, their loads rebased onto the box's corner (as ``channel``
  rebases a produced tensor's). The copy is a flat buffer of whole rows of threads, so the fill
  is one unguarded store per thread and iteration (a dense box the check can prove).
* Inputs whose readers do not overlap in the kernel (one LSTM layer's weights, then the next
  layer's) share one buffer when a grid sync separates the last reader of one from the fill of
  the next.
* An input read by fewer than three stages is left alone: its copy would spare one read at most,
  and the channels (planned after the copies, in the shared memory they leave) get the room.

``plan`` picks the inputs and rewrites the stages; ``kernel.stitch`` allocates the buffers for
the whole kernel (like resident channels) and places the barriers.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Hashable

import numpy as np
import tvm
import tvm.sym as arith
import tvm_ffi
from tvm import tirx

from . import dependence
from ..cost import tir_stats
from ..core.geometry import STATIC_SHARED_LIMIT
from ..te.rewrite import uses

MIN_READERS = 3       # a copy spares a read per reader after the first: at least two, or the shared
                      # memory is better left to the channels (planned after the copies)


@dataclass
class Resident:
    key: Hashable                 # the input's key at the call site (``kernel.stitch``'s args)
    readers: list[int]            # the stages reading it, in kernel order; the first fills the copy
    box: list[tuple]              # per dimension: (corner in ``dependence.VB``, extent)
    buffer: tirx.Buffer           # the per-block shared copy (shared by residents that do not overlap)
    name: str                     # the input's name in the kernel
    filled_bytes: int             # what the fills read over all blocks (boxes may overlap: counted once)

    @property
    def bytes(self) -> int:
        """What one block's copy spares the later readers, per reading."""
        return math.prod(e for _, e in self.box) * tir_stats.dtype_bytes(self.buffer.ty.dtype)


def plan(views: list[dependence.StageView], args: list[list], access: list[tuple[list, list]],
         needs: list[str], param_of: dict, own_shared: list[int], grid: int,
         block: int) -> tuple[list[Resident], list[dependence.StageView]]:
    """The inputs of a stitched kernel on ``grid`` blocks of ``block`` threads that each block keeps
    a copy of, and ``views`` with their loads rebased onto the copies (the first reader's body
    filling it first).

    ``views``, ``args``, ``access``, ``needs``, ``param_of``: as ``channel.plan`` takes them;
    ``own_shared[i]``: the shared bytes stage ``i`` allocates itself. The copies and the
    hungriest stage stay within the static limit (``STATIC_SHARED_LIMIT``); the channels are
    planned after them, in what is left."""
    readers: dict = {}
    written: set = set()
    for i, (keys, (reads, writes)) in enumerate(zip(args, access)):
        for k, r, w in zip(keys, reads, writes):
            if w:
                written.add(k)
            if r:
                readers.setdefault(k, [])
                if i not in readers[k]:
                    readers[k].append(i)
    chosen: list[Resident] = []
    free: dict = {}               # (size, dtype) -> [(buffer, last reader)] already placed
    budget = STATIC_SHARED_LIMIT - max(own_shared, default=0)
    views = list(views)
    for k, every in readers.items():
        if k in written:
            continue
        # the readers of one block count at most the grid (a block runs one virtual block of
        # each), the count most of them share; the others read global memory as before
        # (and one lane: a block's copy is one virtual block's box)
        sizes = [(views[r].blocks, views[r].lane) for r in every if views[r].blocks <= grid]
        rs = [r for r in every if sizes and (views[r].blocks, views[r].lane) == max(set(sizes), key=sizes.count)]
        if len(rs) < MIN_READERS or views[rs[0]].threads != block:
            continue          # nothing to spare, or the fill would be narrower than the block
        buf = param_of[k]
        box = dependence.read_box([(views[r], buf) for r in rs], [int(d) for d in buf.ty.shape])
        if box is None:
            continue
        size = -(-math.prod(e for _, e in box) // block) * block      # whole rows of threads
        dtype = str(buf.ty.dtype)
        reuse = next((i for i, (_, last) in enumerate(free.get((size, dtype), []))
                      if any(n == dependence.GRID for n in needs[last + 1:rs[0] + 1])), None)
        nbytes = size * tir_stats.dtype_bytes(dtype)
        if reuse is None and nbytes > budget:
            continue
        copy = (tirx.decl_buffer([size], dtype, f"{buf.name}_resident", scope="shared") if reuse is None
                else free[(size, dtype)][reuse][0])
        res = Resident(k, list(rs), box, copy, str(buf.name), _union(box, views[rs[0]].blocks, buf))
        try:
            moved = {r: dataclasses.replace(views[r], body=rebase(views[r].body, buf, res, views[r].blocks))
                     for r in rs}
        except ValueError:        # reached other than by loads (an address taken): left in global memory
            continue
        first = views[rs[0]]
        filler = fill(res, buf, first.tid, block)
        # what the static check will ask: every later read of the copy inside what the fill wrote
        by_fill = dependence.StageView(filler, first.tid, first.blocks, block, first.lane)
        if any(dependence.barrier_needed(by_fill, copy, moved[r], copy) == dependence.GRID for r in rs[1:]):
            continue
        if reuse is None:
            budget -= nbytes
        else:
            free[(size, dtype)].pop(reuse)
        for r, view in moved.items():
            views[r] = view
        views[rs[0]] = dataclasses.replace(moved[rs[0]], body=tirx.SeqStmt([filler, dependence.block_barrier(),
                                                                            moved[rs[0]].body]))
        free.setdefault((size, dtype), []).append((copy, rs[-1]))
        chosen.append(res)
    return chosen, views


def _union(box: list[tuple], blocks: int, param) -> int:
    """Bytes of ``param`` inside at least one virtual block's ``box``."""
    shape = [int(d) for d in param.ty.shape]
    ana = arith.Analyzer()
    covered = np.zeros(shape, dtype=bool)
    for vb in range(blocks):
        at = {dependence.VB: tirx.const(vb, "int64")}
        corner = [int(ana.simplify(tvm_ffi.structural_map(c, (tirx.Var, lambda v: at.get(v, v))))) for c, _ in box]
        covered[tuple(slice(c, c + e) for c, (_, e) in zip(corner, box))] = True
    return int(covered.sum()) * tir_stats.dtype_bytes(param.ty.dtype)


def copies(residents: list[Resident]) -> list[tirx.Buffer]:
    """The distinct shared buffers ``residents`` occupy (inputs whose readers do not overlap share one)."""
    return list({id(r.buffer): r.buffer for r in residents}.values())


def fill(res: Resident, param, tid: tirx.Var, block: int) -> tirx.Stmt:
    """Virtual block ``VB``'s box of ``param`` copied into ``res.buffer`` (row-major), ``block``
    threads storing consecutive elements; the last row of threads repeats the box's last element
    where the box is not a whole number of rows (so that no store is guarded)."""
    extents = [e for _, e in res.box]
    n = math.prod(extents)
    size = int(res.buffer.ty.shape[0])
    j = tirx.Var("fill", "int64")
    e = j * tirx.const(block, "int64") + tid
    src = tirx.min(e, tirx.const(n - 1, "int64")) if size > n else e
    idx, rest = [], src
    for d in reversed(range(len(extents))):
        ext = tirx.const(extents[d], "int64")
        idx.append(res.box[d][0] + (tirx.floormod(rest, ext) if d else rest))
        rest = tirx.floordiv(rest, ext)
    load = tirx.BufferLoad(param, list(reversed(idx)))
    return tirx.For(j, tirx.const(0, "int64"), tirx.const(size // block, "int64"), tirx.ForKind.SERIAL,
                    tirx.BufferStore(res.buffer, load, [e]))


def rebase(body: tirx.Stmt, param, res: Resident, blocks: int) -> tirx.Stmt:
    """``body`` (vb form, ``blocks`` virtual blocks) with its loads of ``param`` reading ``res``'
    copy: each index less the box's corner, flattened row-major over the box. (Simplified for
    ``VB`` below ``blocks``: a stage's ``vb % blocks`` less the corner's ``vb`` is no index
    arithmetic left for the kernel, nor registers to hold it.)"""
    ana = arith.Analyzer()
    ana.bind(dependence.VB, tvm.ir.Range.from_min_extent(tirx.const(0, "int64"), tirx.const(blocks, "int64")))

    def load(x):
        if not x.source.same_as(param):
            return x
        flat = tirx.const(0, "int64")
        for idx, (base, ext) in zip(x.indices, res.box):
            wide = idx if str(idx.ty) == "int64" else tirx.Cast("int64", idx)
            flat = flat * tirx.const(ext, "int64") + (wide - base)
        return tirx.BufferLoad(res.buffer, [ana.simplify(flat)])

    out = tvm_ffi.structural_map(body, (tvm.ir.TensorLoad, load))
    if uses(out, [param]):
        raise ValueError(f"{param.name}: used other than by loads")
    return out


