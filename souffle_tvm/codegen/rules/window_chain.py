"""WindowChain: a contraction and the windowed reduction that reads it, one kernel, the
contraction's output tile (with its halo) in shared memory.

EfficientNet's MBConv expands with a 1 x 1 convolution and then runs a depthwise k x k
convolution over the expanded tensor: as two kernels the expanded tensor (six times the block's
input) goes to global memory and back. Here each block takes a slab of channels and a spatial
tile of the depthwise output, computes the part of the expanded tensor that tile's windows read
(its halo recomputed by the neighbouring blocks, clipped at the borders) into shared memory, one
element per thread at a time with the contraction's terms summed in the thread, and then the
depthwise outputs from shared memory, one per thread, with their epilogue. The TIR is TVM's own
``compute_at`` of the producer under the consumer's block loop: TVM derives the halo region and
the border predicate.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import normalize_prim_func

from ...cost import hardware, tir_stats
from ...core.geometry import STATIC_SHARED_LIMIT
from ...core.ir_names import MIN_BLOCKS_ATTR
from .base import CUDAScheduleRule

# A spatial tile side: the whole map where it is this small (no halo to recompute), else the
# largest divisor of the side up to it.
MAX_TILE_SIDE = 16
# Channels a block takes at most; fewer where the grid would not cover the SMs.
MAX_CHANNELS = 16
MIN_CHANNELS = 4
# Registers a thread may use (the kernel's ``__launch_bounds__`` minimum blocks is set for them).
REGISTERS = 64


class WindowChain(CUDAScheduleRule):
    """Schedules ``[contraction, elementwise..., windowed reduction, elementwise...]``: the
    windowed reduction reads the last elementwise stage before it through a window over its two
    innermost axes (the partitioner's ``window`` groups, ``partition.kernels``)."""

    def __init__(self, block_size: int):
        self.block_size = block_size

    def apply(self, func: tirx.PrimFunc, target, tunable: bool) -> s_tir.Schedule | None:
        got = self.root_blocks(func, target)
        if got is None:
            return None
        sch = got[0]
        infos = normalize_prim_func(sch)
        if infos is None:
            return None
        reductions = [i for i, info in enumerate(infos) if info.is_reduction()]
        if len(reductions) != 2 or reductions[0] != 0 or reductions[1] - reductions[0] < 2:
            return None      # the contraction, an elementwise stage its output goes through, the window
        p, w = reductions
        if any(info.is_reduction() for info in infos[w + 1:]):
            return None
        window, tile = infos[w], infos[w - 1].block_rv
        loops = sch.get_loops(window.block_rv)
        spatial = [lp for lp, k in zip(loops, window.dom_kind()) if k == "S"]
        terms = [lp for lp, k in zip(loops, window.dom_kind()) if k == "R"]
        if len(spatial) < 3 or len(spatial) + len(terms) != len(loops):
            return None
        extents = [sch.get(lp).extent for lp in spatial]
        if not all(isinstance(e, tirx.IntImm) for e in extents):
            return None
        *outer, chan, rows, cols = spatial
        c, h, wd = (int(e) for e in extents[-3:])
        th, tw = _side(h), _side(wd)
        buffer = sch.get(tile).writes[0].source
        halo = _halo(sch.get(window.block_rv), buffer, th, tw)
        if halo is None:
            return None
        sms = hardware.for_arch(str(target.attrs.get("arch", "sm_90"))).sms
        tc = _channels(c, (h // th) * (wd // tw), halo, th * tw, self.block_size,
                       tir_stats.dtype_bytes(str(buffer.ty.dtype)), sms)
        if tc is None:
            return None
        try:
            for info in infos[p + 1:w - 1]:          # the elementwise stages before the tile's own
                sch.compute_inline(info.block_rv)
            for info in reversed(infos[w + 2:]):     # the window's epilogue as one stage
                sch.reverse_compute_inline(info.block_rv)
            co, ci = sch.split(chan, [None, tc])
            ho, hi = sch.split(rows, [None, th])
            wo, wi = sch.split(cols, [None, tw])
            sch.reorder(*outer, co, ho, wo, ci, hi, wi, *terms)
            bx = sch.fuse(*outer, co, ho, wo)
            _, tx = sch.split(sch.fuse(ci, hi, wi), [None, self.block_size])
            sch.bind(bx, "blockIdx.x")
            sch.bind(tx, "threadIdx.x")
            if len(infos) > w + 1:
                sch.reverse_compute_at(infos[w + 1].block_rv, tx)
            if len(infos) > w + 1:                   # the sums stay in registers for the epilogue
                sch.set_scope(window.block_rv, 0, "local")
            # the window's tile of the contraction, halo and border predicate derived by TVM
            sch.compute_at(tile, bx)
            sch.set_scope(tile, 0, "shared")
            _pixel_per_thread(sch, tile, infos[p], self.block_size)
            sch.decompose_reduction(window.block_rv, terms[0])
        except (RuntimeError, ValueError):           # tvm's ScheduleError: not this structure
            return None
        out = sch.mod["main"]
        if len(infos) > w + 1:
            out = _guarded(out, sch.get(window.block_rv).name_hint, sch.get(infos[w + 1].block_rv).name_hint)
        # ptxas sizes a kernel without a minimum for four blocks per SM: 32 registers at 512
        # threads, where the stem's chain spilled; room for 64 (``__launch_bounds__``)
        blocks = max(1, hardware.for_arch(str(target.attrs.get("arch", "sm_90"))).regs_per_sm
                     // (self.block_size * REGISTERS))
        return s_tir.Schedule(out.with_attr(MIN_BLOCKS_ATTR, tirx.const(blocks, "int32")))



def _pixel_per_thread(sch: s_tir.Schedule, tile, contraction, threads: int) -> None:
    """The tile's phase: a thread per pixel of the tile and all the block's channels in its
    registers, each operand value copied into registers once per term and used for every channel
    (a thread per element re-read the activation once per channel: 1875 against 981 MB of L1
    sectors on EfficientNet-B0). ``contraction``: its block's info."""
    *rest, ec, eh, ew = sch.get_loops(tile)[1:]
    sch.reorder(*rest, eh, ew, ec)
    _, etx = sch.split(sch.fuse(*rest, eh, ew), [None, threads])
    sch.bind(etx, "threadIdx.x")
    sch.unroll(ec)
    block = contraction.block_rv
    sch.compute_at(block, etx, preserve_unit_loops=True)
    sch.set_scope(block, 0, "local")
    depth = len(sch.get_loops(tile)) - 1             # the tile's loops end with etx, ec
    kinds = contraction.dom_kind()
    inner = sch.get_loops(block)[depth:]
    summed = [lp for lp, k in zip(inner, kinds) if k == "R"]
    kept = [lp for lp, k in zip(inner, kinds) if k == "S"]
    if len(inner) != len(kinds) or not summed:
        return
    sch.reorder(*summed, *kept)
    for lp in kept:
        sch.unroll(lp)
    for i in range(len(sch.get(block).reads)):
        copy = sch.cache_read(block, i, "local")
        sch.compute_at(copy, summed[-1])
        for lp in sch.get_loops(copy)[depth + len(summed):]:
            sch.unroll(lp)                           # registers, not a local-memory array


def _channels(c: int, tiles: int, halo: int, per_channel: int, threads: int, elem: int, sms: int) -> int | None:
    """Channels per block: those whose tile of the contraction fits half the static shared
    memory, giving the block at least one output per thread where they can; of those the most
    (up to MAX_CHANNELS) that still give every SM a block, else the fewest. ``tiles``: spatial
    tiles; ``halo``: elements of one channel's tile; ``per_channel``: outputs of one channel."""
    fits = [d for d in range(1, min(c, MAX_CHANNELS) + 1) if c % d == 0 and d * halo * elem <= STATIC_SHARED_LIMIT // 2]
    if not fits:
        return None
    full = [d for d in fits if d * per_channel >= threads] or [max(fits)]
    wide = [d for d in full if (c // d) * tiles >= sms]
    return max(wide) if wide else min(full)


def _guarded(func: tirx.PrimFunc, window: str, epilogue: str) -> tirx.PrimFunc:
    """``func`` with the window's epilogue under the window's predicate: a tile that is not a
    multiple of the block's threads leaves the last threads idle, and ``reverse_compute_at``
    derives the epilogue's region without that predicate (it would write the next tile's
    outputs from values never computed)."""
    guards = {}

    def note(realize) -> None:
        guards.setdefault(realize.block.name_hint, realize.predicate)
    tvm_ffi.structural_walk(func.body, (s_tir.SBlockRealize, note))
    guard = guards.get(f"{window}_update", guards.get(window))
    if guard is None or (isinstance(guard, tirx.IntImm) and int(guard) == 1):
        return func

    def fix(realize):
        if realize.block.name_hint != epilogue:
            return realize
        own = realize.predicate
        both = guard if isinstance(own, tirx.IntImm) and int(own) == 1 else tirx.And(own, guard)
        return s_tir.SBlockRealize(list(realize.iter_values), both, realize.block)
    return func.with_body(tvm_ffi.structural_map(func.body, (s_tir.SBlockRealize, fix)))


def _side(n: int) -> int:
    return n if n <= MAX_TILE_SIDE else max(d for d in range(1, MAX_TILE_SIDE + 1) if n % d == 0)


def _halo(block: s_tir.SBlock, buffer, th: int, tw: int) -> int | None:
    """Elements of ``buffer`` one th x tw tile of ``block``'s outputs reads per channel: the
    window's rows and columns, (side - 1) x stride + window each, clipped to the map."""
    reads = [r for r in block.reads if r.source.same_as(buffer)]
    spatial = [iv for iv in block.iter_vars if iv.iter_type == tirx.IterVar.DataPar]
    if len(reads) != 1 or len(spatial) < 2 or len(buffer.ty.shape) < 2:
        return None
    dom = {iv.var: tvm.sym.IntervalSet(0, 0) for iv in spatial[:-2]}
    dom.update({iv.var: tvm.sym.IntervalSet(0, side - 1) for iv, side in zip(spatial[-2:], (th, tw))})
    dom.update({iv.var: tvm.sym.IntervalSet(iv.dom.min, iv.dom.min + iv.dom.extent - 1)
                for iv in block.iter_vars if iv.iter_type == tirx.IterVar.CommReduce})
    analyzer, out = tvm.sym.Analyzer(), 1
    for rng, size in zip(list(reads[0].region)[-2:], list(buffer.ty.shape)[-2:]):
        span = analyzer.int_set(rng.min, dom)
        lo, hi = span.min_value, span.max_value
        if not isinstance(lo, tirx.IntImm) or not isinstance(hi, tirx.IntImm) or not isinstance(size, tirx.IntImm):
            return None
        out *= min(int(hi) - int(lo) + 1, int(size))
    return out
