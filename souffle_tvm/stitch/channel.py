"""The on-chip channel: a block-local intermediate of a stitched kernel lives in shared memory.

Stitching earns its time only where the tensor between two stages never leaves the chip. When
``dependence`` proves that every element virtual block ``vb`` of a consumer stage reads was
written by virtual block ``vb`` of its producer, the consumer need not read it from global
memory: each block keeps the producer's box of the tensor in a ``shared`` buffer sized by that
box, and both stages index it relative to the box's corner. Two forms, by how a block's
virtual blocks follow one another:

* **resident**: the producer has no more virtual blocks than the grid has blocks, so block
  ``b`` runs virtual block ``b`` of every such stage and nothing else. The buffer is allocated
  once for the whole kernel and outlives grid syncs (a squeeze-excite's pool between a
  depthwise convolution and its scaling, a two-phase reduction's partials between a GEMM and
  its normalisation). A consumer tiled otherwise (more virtual blocks, or reads another block's
  box) still reads global memory, so the producer then writes both (``dual``), as it does when
  something after the kernel reads the tensor.
* **fused**: more virtual blocks than blocks. Walking them grid-stride, a block would
  overwrite its box with the next one before the consumer read it, so the producer, its
  consumers and every stage between them run in ONE grid-stride loop over the same virtual
  blocks (``kernel``), each iteration producer then consumers, with a ``__syncthreads()``
  between them where the dependence is block-local (none where it is thread-local) and one at
  the end of the iteration before the next overwrites the box. No grid sync may come between,
  every reader must read on chip, and nothing after the kernel may read the tensor, which then
  never leaves the chip at all.

``plan`` picks the channels and the stage spans they fuse, and rewrites the stages' accesses
onto the channels' buffers (``rebase``); ``kernel.stitch`` builds the kernel from them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Hashable

import tvm
import tvm.sym as arith
import tvm_ffi
from tvm import tirx

from . import dependence
from ..cost import tir_stats
from ..core.geometry import STATIC_SHARED_LIMIT
from ..te.rewrite import uses



@dataclass
class Channel:
    key: Hashable                 # the tensor's key at the call site (``kernel.stitch``'s args)
    writer: int                   # the stage that makes it
    readers: list[int]            # the stages that read it on chip (after the writer)
    box: list[tuple]              # per dimension: (corner in ``dependence.VB``, extent)
    buffer: tirx.Var              # the per-block shared buffer
    resident: bool                # allocated for the whole kernel (else per fused-loop iteration)
    dual: bool                    # the writer stores the global tensor too (a reader needs it)

    @property
    def bytes(self) -> int:
        return tir_stats.buffer_bytes(self.buffer)


def plan(views: list[dependence.StageView], args: list[list], access: list[tuple[list, list]],
         needs: list[str], param_of: dict, private: Callable[[Hashable], bool],
         own_shared: list[int], grid: int, reserved: int = 0, block: int = 0,
         scoped: bool = False) -> tuple[list[Channel], list[tuple[int, int]], list]:
    """The channels of a stitched kernel on ``grid`` blocks, the stage spans ``(first, last)``
    to fuse for them, and ``views`` with the channels' accesses rebased onto them.

    ``views``, ``args``, ``access``: per stage its vb-form view, its parameters' keys and per
    parameter whether it reads and writes it; ``needs[i]``: the barrier stage ``i`` needs
    before it (``dependence``); ``private(key)``: the tensor is made here and not read after
    the kernel; ``own_shared[i]``: the shared bytes stage ``i`` allocates itself. The channels
    live at once and the stages' shared memory stay within the static limit (``STATIC_SHARED_LIMIT``)
    less ``reserved`` (the kernel's other shared buffers: ``resident`` copies). ``block``: the
    kernel's threads per block. ``scoped``: a channel whose readers all run in its writer's
    segment is fused even where it could be resident, so its buffer lives for its span, not
    for the kernel (a wave kernel's cells: every wave's would otherwise hold shared memory to
    the end, and the later waves find none left).
    """
    n = len(views)
    seg = [0] * n      # stages of one segment: no grid sync between them, as many blocks
    for i in range(1, n):
        same = (needs[i] != dependence.GRID and views[i].blocks == views[i - 1].blocks
                and views[i].lane == views[i - 1].lane)
        seg[i] = seg[i - 1] if same else seg[i - 1] + 1
    writers: dict = {}
    readers: dict = {}
    for i, (keys, (reads, writes)) in enumerate(zip(args, access)):
        for k, r, w in zip(keys, reads, writes):
            if w:
                writers.setdefault(k, []).append(i)
            if r:
                readers.setdefault(k, []).append(i)
    channels: list[Channel] = []
    for k, ws in writers.items():
        if len(ws) != 1 or any(r < ws[0] for r in readers.get(k, [])):   # one writer, no reader before it
            continue
        w, buf = ws[0], param_of[k]
        later = [r for r in dict.fromkeys(readers.get(k, [])) if r > w]
        local = [r for r in later if views[r].blocks == views[w].blocks
                 and dependence.barrier_needed(views[w], buf, views[r], buf) != dependence.GRID]
        dual = len(local) < len(later) or not private(k)
        resident = views[w].blocks <= grid and not (scoped and not dual and all(seg[r] == seg[w] for r in local))
        if not local or (not resident and (dual or any(seg[r] != seg[w] for r in local))):
            continue
        box = dependence.covering_box(views[w], buf, [(views[r], buf) for r in local], block, dual)
        if box is not None:
            shape = [int(e) for _, e in box]
            channels.append(Channel(k, w, local, box, tirx.decl_buffer(shape, str(buf.ty.dtype), f"{buf.name}_onchip",
                                                                       scope="shared"), resident, dual))
    kept, views = [], list(views)
    for ch in _within_budget(channels, own_shared, STATIC_SHARED_LIMIT - reserved):
        try:        # every access of the tensor moves on chip, or the channel is dropped
            moved = {i: rebase(views[i].body, param_of[ch.key], ch, i == ch.writer) for i in [ch.writer] + ch.readers}
        except ValueError:      # reached other than by loads and stores (an address taken)
            continue
        for i, body in moved.items():
            views[i] = dataclasses.replace(views[i], body=body)
        kept.append(ch)
    return kept, _merge([[ch.writer, max(ch.readers)] for ch in kept if not ch.resident]), views


def _within_budget(channels: list[Channel], own_shared: list[int], limit: int) -> list[Channel]:
    """Channels taken in order while, with the resident ones and each fused span's, the
    hungriest stage's own shared memory fits ``limit``."""
    kept: list[Channel] = []
    for ch in channels:
        trial = kept + [ch]
        spans = _merge([[c.writer, max(c.readers)] for c in trial if not c.resident])
        resident = sum(c.bytes for c in trial if c.resident)
        fused = [sum(c.bytes for c in trial if not c.resident and a <= c.writer <= b) + max(own_shared[a:b + 1])
                 for a, b in spans]
        if resident + max(fused + [max(own_shared)]) <= limit:
            kept.append(ch)
    return kept


def _merge(spans: list[list[int]]) -> list[tuple[int, int]]:
    """Overlapping stage spans merged, in order."""
    out: list[list[int]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def rebase(body: tirx.Stmt, param, channel: Channel, writer: bool = False) -> tirx.Stmt:
    """``body`` (vb form) with its loads and stores of ``param`` moved to ``channel``'s buffer,
    each index less the box's corner; in the ``writer`` of a ``dual`` channel each store also
    goes on to global memory."""
    ana = arith.Analyzer()

    def local(indices):
        out = []
        for idx, (base, _) in zip(indices, channel.box):
            wide = idx if str(idx.ty) == "int64" else tirx.Cast("int64", idx)
            out.append(ana.simplify(wide - base))
        return out

    def load(x):
        return tirx.BufferLoad(channel.buffer, local(list(x.indices))) if x.source.same_as(param) else x

    def store(s):
        if not s.buffer.same_as(param):
            return s
        mine = local(list(s.indices))
        on_chip = tirx.BufferStore(channel.buffer, s.value, mine)
        if not (writer and channel.dual):
            return on_chip
        # the value once, into both: reading the tile back would need a barrier between the two
        # stores of one thread (TVM's ThreadSync, before flattening, sees a conflict there)
        value = tirx.Var(f"{param.name}_value", s.value.ty)
        return tirx.SeqStmt([tirx.Bind(value, s.value), tirx.BufferStore(channel.buffer, value, mine),
                             tirx.BufferStore(param, value, list(s.indices))])

    out = tvm_ffi.structural_map(body, [(tvm.ir.TensorLoad, load), (tirx.BufferStore, store)])
    if not (writer and channel.dual) and uses(out, [param]):
        raise ValueError(f"{param.name}: used other than by loads and stores")
    return out
