"""Work and traffic of TIR, read from the IR itself (no operator names involved).

* ``block_flops``: useful floating-point operations of every SBlock of an *unscheduled*
  PrimFunc: instances (product of the block's iteration domains) × float ops in its store.
* ``kernel_global_buffers``: the global buffers a lowered device kernel declares; their sizes
  are the kernel's compulsory traffic (each byte read or written at least once).

Buffers are told apart by identity, and across lowering by parameter position, never by name:
topi names an activation's input and output ``compute`` alike, so a group PrimFunc often has
two parameters of one name (``distinct_param_names`` renames them before TVM lowers them, so
that its device kernels' buffers can be traced back to their positions).
"""

from __future__ import annotations

import math

import tvm
import tvm_ffi
from tvm import s_tir, tirx

from .work import Stage

_ARITH = (tirx.Add, tirx.Sub, tirx.Mul, tirx.Div, tirx.Max, tirx.Min)
# Transcendentals and friends count as one operation each (the usual roofline convention).
_MATH_CALLS = {"tirx.exp", "tirx.exp2", "tirx.log", "tirx.tanh", "tirx.sigmoid", "tirx.erf", "tirx.sqrt",
               "tirx.rsqrt", "tirx.pow", "tirx.fabs", "tirx.cos", "tirx.sin", "tirx.log1p", "tirx.fmod"}


def _is_float(dtype) -> bool:
    return str(dtype).startswith(("float", "bfloat"))


def expr_flops(expr) -> int:
    """Float operations in one expression (integer index arithmetic is not counted)."""
    count = 0

    def arith(node):
        nonlocal count
        if _is_float(node.ty):
            count += 1

    def call(node):
        nonlocal count
        op = getattr(node, "op", None)
        if op is not None and getattr(op, "name", "") in _MATH_CALLS:
            count += 1

    tvm_ffi.structural_walk(expr, [(_ARITH, arith), (tvm.ir.Call, call)])
    return count


def extent(iv) -> int:
    """An iteration variable's static extent (1 where it is not a constant)."""
    ext = iv.dom.extent
    return int(ext.value) if hasattr(ext, "value") else 1


def dtype_bytes(dtype) -> int:
    dt = tvm.DataType(str(dtype))
    return max(dt.bits * dt.lanes // 8, 1)


def _sblock_flops(blk) -> int:
    """Flops of one SBlock of an unscheduled PrimFunc: its instances x its body's arithmetic
    (0 for a block that is not one store)."""
    if not blk.iter_vars or not isinstance(blk.body, tirx.BufferStore):
        return 0
    return math.prod(extent(iv) for iv in blk.iter_vars) * expr_flops(blk.body.value)


def heaviest_block(func: tirx.PrimFunc) -> tuple[str, int, int, int]:
    """(name, flops, bytes of its parameter footprint, bytes it writes) of the SBlock of an
    unscheduled PrimFunc with the most flops: a GEMM group's contraction, the same whether or not
    an epilogue is fused into the group."""
    best = ("", 0, None)

    def visit(blk):
        nonlocal best
        flops = _sblock_flops(blk)
        if flops > best[1]:
            best = (str(blk.name_hint), flops, blk)

    tvm_ffi.structural_walk(func.body, (s_tir.SBlock, visit))
    name, flops, blk = best
    if blk is None:
        return "", 0, 0, 0
    foot = block_footprints(func, name)
    positions = param_positions(func)
    written = sum(foot.get(positions.get(w.source), 0) for w in blk.writes)
    return name, flops, sum(foot.values()), written


def block_flops(func: tirx.PrimFunc) -> dict[str, int]:
    """{written buffer name: flops} over the SBlocks of an unscheduled PrimFunc."""
    out: dict[str, int] = {}

    def visit(blk):
        if not blk.iter_vars or not isinstance(blk.body, tirx.BufferStore):
            return
        name = blk.writes[0].source.name if blk.writes else blk.name_hint
        out[name] = out.get(name, 0) + _sblock_flops(blk)

    tvm_ffi.structural_walk(func.body, (s_tir.SBlock, visit))
    return out


def buffer_bytes(buf) -> int:
    ty = buf.ty
    return math.prod(int(d.value) if hasattr(d, "value") else 1 for d in ty.shape) * dtype_bytes(ty.dtype)


def is_global(buf) -> bool:
    return str(buf.ty.storage_scope or "global") == "global"


def param_positions(func: tirx.PrimFunc) -> dict:
    """{parameter buffer: its position in ``func.params``} (keyed by identity)."""
    return {p: i for i, p in enumerate(func.params) if hasattr(p.ty, "shape")}


def distinct_param_names(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` with its buffer parameters renamed where two share a name (the second
    ``compute`` becomes ``compute_1``): the same function, whose lowered kernels' buffers, which
    keep their parameters' names, can be traced back to their positions."""
    taken = {str(p.name) for p in func.params}
    seen: set[str] = set()
    subst = {}
    for p in func.params:
        name = str(p.name)
        if name in seen and hasattr(p.ty, "shape"):
            k = 1
            while f"{name}_{k}" in taken:
                k += 1
            taken.add(f"{name}_{k}")
            subst[p] = tirx.Var(f"{name}_{k}", p.ty)
        seen.add(name)
    if not subst:
        return func
    body = tvm_ffi.structural_map(func.body, (tirx.Var, lambda v: subst.get(v, v)))
    return tirx.PrimFunc([subst.get(p, p) for p in func.params], body, attrs=func.attrs)


def _kernel_keys(kernel: tirx.PrimFunc, positions: dict[str, int]) -> dict:
    """{global buffer a device kernel declares: its key}: the launching PrimFunc's parameter
    position (``positions``: name -> position, names made distinct by ``distinct_param_names``),
    else the buffer's name (a scheduler's global scratch), made distinct where two share it."""
    keys: dict = {}

    def decl(node):
        buf = node.buffer
        if not is_global(buf) or buf in keys:
            return
        key = positions.get(str(buf.name), str(buf.name))
        taken = set(keys.values())
        k = 1
        while key in taken:            # never lose a buffer to a name it shares
            key, k = f"{buf.name}#{k}", k + 1
        keys[buf] = key

    tvm_ffi.structural_walk(kernel.body, (tirx.DeclBuffer, decl))
    return keys


def kernel_global_buffers(kernel: tirx.PrimFunc, positions: dict[str, int]) -> tuple[dict, set]:
    """({key: bytes} of the global buffers a device kernel declares over its pointer params, the
    keys of those it stores to), keyed by the launching PrimFunc's parameter position (a name for
    global scratch; ``_kernel_keys``)."""
    keys = _kernel_keys(kernel, positions)
    stored: set = set()
    tvm_ffi.structural_walk(kernel.body, (tirx.BufferStore, lambda s: stored.add(keys[s.buffer])
                                          if s.buffer in keys else None))
    return {key: buffer_bytes(buf) for buf, key in keys.items()}, stored


def launch_extents(kernel: tirx.PrimFunc) -> tuple[list[int], list[int]]:
    """(grid [x, y, z], block [x, y, z]) from a device kernel's thread_extent attributes."""
    ext = {}

    def attr(node):
        if node.attr_key == "thread_extent":
            v = node.value
            ext[node.node.var.name] = int(v.value) if hasattr(v, "value") else -1

    tvm_ffi.structural_walk(kernel.body, (tirx.AttrStmt, attr))
    grid = [ext.get(f"blockIdx.{a}", 1) for a in "xyz"]
    block = [ext.get(f"threadIdx.{a}", 1) for a in "xyz"]
    return grid, block


def global_scratch_buffers(func: tirx.PrimFunc) -> list:
    """The global buffers a scheduled PrimFunc allocates itself, in order: what a function lowered
    to several kernels passes between them (``stitch.lower`` makes them scratch parameters)."""
    found: list = []

    def add(buf):
        if is_global(buf):
            found.append(buf)

    def block(blk):
        for buf in blk.alloc_buffers:
            add(buf)

    tvm_ffi.structural_walk(func.body, [(s_tir.SBlock, block), (tirx.AllocBuffer, lambda a: add(a.buffer))])
    return found


def global_scratch_bytes(func: tirx.PrimFunc) -> int:
    """Bytes of ``global_scratch_buffers`` (each written by one kernel and read by another)."""
    return sum(buffer_bytes(b) for b in global_scratch_buffers(func))


def primfunc_param_bytes(func: tirx.PrimFunc) -> int:
    """Bytes of a PrimFunc's buffer parameters: what one call reads and writes at least once."""
    return sum(buffer_bytes(p) for p in func.params if hasattr(p.ty, "shape"))


def _uses_load(expr) -> bool:
    found = False

    def hit(_):
        nonlocal found
        found = True

    tvm_ffi.structural_walk(expr, (tvm.ir.TensorLoad, hit))
    return found


def vars_in(*exprs) -> set:
    """The variables the expressions use."""
    seen = set()
    for e in exprs:
        tvm_ffi.structural_walk(e, (tirx.Var, lambda v: seen.add(v)))
    return seen


def _span(index, ext: int, dim: int, ana, extents: dict) -> tuple[int, int, int]:
    """(lo, hi, values) of one dimension of an access: the interval it spans and how many of its
    elements it can touch, at most one per combination of the iteration variables its index uses
    (a stride-2 convolution's 2*i spans 2n - 1 elements and touches n). An index read from data
    (take, gather) spans the whole dimension and touches as many rows as its variables select."""
    used = vars_in(index)
    if _uses_load(index):
        return 0, dim - 1, min(dim, math.prod(extents.get(v, 1) for v in used) * ext)
    b = ana.const_int_bound(index)
    lo, hi = max(int(b.min_value), 0), min(int(b.max_value) + ext - 1, dim - 1)
    values = max(hi - lo + 1, 0) if hi >= lo else dim
    if all(v in extents for v in used):
        values = min(values, math.prod(extents[v] for v in used) * ext)
    return lo, hi, values


def _disjoint(a: list, b: list) -> bool:
    return any(x[1] < y[0] or y[1] < x[0] for x, y in zip(a, b))


def _union_elems(boxes: list[tuple[list, int]]) -> int:
    """Elements in the union of boxes ((lo, hi) per dimension, elements touched): disjoint boxes
    add up; overlapping ones merge into their bounding box, counting no more than it holds nor
    than they touch together (an upper bound either way)."""
    boxes = list(dict.fromkeys((tuple(spans), n) for spans, n in boxes))
    merged = True
    while merged:
        merged = False
        for i in range(len(boxes)):
            for j in range(i + 1, len(boxes)):
                (a, na), (b, nb) = boxes[i], boxes[j]
                if not _disjoint(a, b):
                    spans = tuple((min(x[0], y[0]), max(x[1], y[1])) for x, y in zip(a, b))
                    boxes[j] = (spans, min(math.prod(hi - lo + 1 for lo, hi in spans), na + nb))
                    del boxes[i]
                    merged = True
                    break
            if merged:
                break
    return sum(n for _, n in boxes)


def _body_accesses(blk) -> list:
    """(buffer, indices) of every element access in a block's body and init, nested blocks aside."""
    found = []

    def visit(node):
        if isinstance(node, s_tir.SBlock):
            return tvm_ffi.WalkResult.SKIP
        if isinstance(node, tvm.ir.TensorLoad):
            found.append((node.source, list(node.indices)))
        elif isinstance(node, tirx.BufferStore):
            found.append((node.buffer, list(node.indices)))
        return None

    for part in (blk.body, blk.init):
        if part is not None:
            tvm_ffi.structural_walk(part, visit, order="pre")
    return found


def block_footprints(func: tirx.PrimFunc, only: str | None = None) -> dict[int, int]:
    """{parameter position: bytes} a PrimFunc touches, from its blocks' accesses (``only``: the
    block of that name alone).

    Each access in a block's body is bounded as a box over the block's iteration domain
    (``_span`` per dimension; a block whose body does not show its accesses of a buffer counts
    its access region instead), and a buffer's boxes are united over every access of every
    block (``_union_elems``): an LSTM cell reading its gates at offsets 0, 32 and 48 of one
    vector, in one block or in three, touches 48 elements, where TVM's merged read region
    spans 64 and the largest block's reads 16.
    """
    # Only buffers of static shape have a footprint to report (a legalized opaque op may be symbolic).
    params = {p: i for i, p in enumerate(func.params)
              if hasattr(p.ty, "shape") and all(hasattr(d, "value") for d in p.ty.shape)}
    boxes: dict[int, list] = {}

    def add(pos: int, spans: list) -> None:
        boxes.setdefault(pos, []).append(([(lo, hi) for lo, hi, _ in spans], math.prod(v for _, _, v in spans)))

    def visit(blk):
        if only is not None and blk.name_hint != only:
            return
        ana = tvm.sym.Analyzer()
        extents = {}
        for iv in blk.iter_vars:
            ana.bind(iv.var, iv.dom)
            extents[iv.var] = extent(iv)
        shown = set()
        for buf, indices in _body_accesses(blk):
            if buf in params:
                shape = [int(d.value) for d in buf.ty.shape]
                add(params[buf], [_span(i, 1, d, ana, extents) for i, d in zip(indices, shape)])
                shown.add(params[buf])
        for region in list(blk.reads) + list(blk.writes):
            pos = params.get(region.source)
            if pos is None or pos in shown:
                continue
            shape = [int(d.value) for d in region.source.ty.shape]
            add(pos, [_span(rng.min, int(rng.extent.value) if hasattr(rng.extent, "value") else dim, dim, ana, extents)
                      for dim, rng in zip(shape, region.region)])

    tvm_ffi.structural_walk(func.body, (s_tir.SBlock, visit))
    out = {}
    for pos, found in boxes.items():
        p = func.params[pos]
        out[pos] = min(_union_elems(found), math.prod(int(d.value) for d in p.ty.shape)) * dtype_bytes(p.ty.dtype)
    return out


_TENSOR_CORE_OPS = ("mma", "ldmatrix", "load_matrix_sync", "store_matrix_sync", "fill_fragment")


def uses_tensor_cores(func: tirx.PrimFunc) -> bool:
    """Whether ``func`` runs on tensor cores: an MMA/ldmatrix intrinsic or a fragment-scoped
    buffer (TVM's tensorized GEMMs, dlight's MatmulTensorization, WMMA)."""
    found = []

    def call(c):
        name = getattr(c.op, "name", "")
        if any(op in name for op in _TENSOR_CORE_OPS):
            found.append(name)

    def alloc(a):
        if str(a.buffer.ty.storage_scope).startswith(("wmma.", "m16n8k8.", "m16n8k16.")):
            found.append(a.buffer.name)

    tvm_ffi.structural_walk(func.body, [(tvm.ir.Call, call), (tirx.AllocBuffer, alloc)])
    return bool(found)


def stored_element_bytes(func: tirx.PrimFunc) -> int:
    """The element size of what ``func`` stores to global memory (the widest, 4 if none)."""
    sizes = []

    def store(s):
        if is_global(s.buffer):
            sizes.append(dtype_bytes(s.buffer.ty.dtype))

    tvm_ffi.structural_walk(func.body, (tirx.BufferStore, store))
    return max(sizes) if sizes else 4


def stored_positions(func: tirx.PrimFunc) -> set[int]:
    """Positions of the buffer parameters ``func`` stores to."""
    stored: set = set()
    tvm_ffi.structural_walk(func.body, (tirx.BufferStore, lambda s: stored.add(s.buffer)))
    return {i for i, p in enumerate(func.params) if p in stored}


def written_param_bytes(func: tirx.PrimFunc) -> int:
    """Bytes of the buffer parameters ``func`` stores to: its outputs."""
    stored: set = set()
    tvm_ffi.structural_walk(func.body, (tirx.BufferStore, lambda s: stored.add(s.buffer)))
    return sum(buffer_bytes(p) for p in func.params if hasattr(p.ty, "shape") and p in stored)


def work_stages(func: tirx.PrimFunc, geometry: list[tuple[int, int]], nbytes: int, flops: int) -> list[Stage]:
    """The latency model's stages (``cost.latency.Stage``) of ``func``'s launch regions, given as
    (tiles, threads): ``nbytes``, ``flops`` and the bytes ``func`` stores count on the first
    region; whether it uses tensor cores and its stored element size on all."""
    tc, elem, written = uses_tensor_cores(func), stored_element_bytes(func), written_param_bytes(func)
    return [Stage(tiles, threads, nbytes if k == 0 else 0, flops if k == 0 else 0, tc, written if k == 0 else 0, elem)
            for k, (tiles, threads) in enumerate(geometry)]
