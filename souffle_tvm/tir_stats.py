"""Work and traffic of TIR, read from the IR itself (no operator names involved).

* ``block_flops``: useful floating-point operations of every SBlock of an *unscheduled*
  PrimFunc: instances (product of the block's iteration domains) × float ops in its store.
* ``kernel_global_buffers``: the global buffers a lowered device kernel declares; their sizes
  are the kernel's compulsory traffic (each byte read or written at least once).
"""

from __future__ import annotations

import math

import tvm
import tvm_ffi
from tvm import s_tir, tirx

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


def _extent(iv) -> int:
    ext = iv.dom.extent
    return int(ext.value) if hasattr(ext, "value") else 1


def block_flops(func: tirx.PrimFunc) -> dict[str, int]:
    """{written buffer name: flops} over the SBlocks of an unscheduled PrimFunc."""
    out: dict[str, int] = {}

    def visit(blk):
        if not blk.iter_vars or not isinstance(blk.body, tirx.BufferStore):
            return
        instances = math.prod(_extent(iv) for iv in blk.iter_vars)
        ops = expr_flops(blk.body.value)
        name = blk.writes[0].source.name if blk.writes else blk.name_hint
        out[name] = out.get(name, 0) + instances * ops

    tvm_ffi.structural_walk(func.body, (s_tir.SBlock, visit))
    return out


def buffer_bytes(buf) -> int:
    ty = buf.ty
    n = math.prod(int(d.value) if hasattr(d, "value") else 1 for d in ty.shape)
    dt = tvm.DataType(str(ty.dtype))
    return n * max(dt.bits * dt.lanes // 8, 1)


def is_global(buf) -> bool:
    return str(buf.ty.storage_scope or "global") == "global"


def kernel_global_buffers(kernel: tirx.PrimFunc) -> dict[str, int]:
    """{buffer name: bytes} for the global buffers a device kernel declares over its pointer params."""
    found: dict[str, int] = {}

    def decl(node):
        buf = node.buffer
        if is_global(buf):
            found[buf.name] = buffer_bytes(buf)

    tvm_ffi.structural_walk(kernel.body, (tirx.DeclBuffer, decl))
    return found


def kernel_stored_buffers(kernel: tirx.PrimFunc) -> set[str]:
    names: set[str] = set()
    tvm_ffi.structural_walk(kernel.body, (tirx.BufferStore, lambda s: names.add(s.buffer.name)))
    return names


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


def primfunc_param_bytes(func: tirx.PrimFunc) -> int:
    """Bytes of a PrimFunc's buffer parameters: what one call reads and writes at least once."""
    return sum(buffer_bytes(p) for p in func.params if hasattr(p.ty, "shape"))
