"""GPU semantics on the CPU: run scheduled and stitched CUDA kernels with llvm.

A kernel's TIR, lowered to launch form (the stitcher's form: ``launch_thread`` attributes,
grid-stride stage loops, ``grid_sync`` between stages), becomes a CPU PrimFunc that keeps
what the GPU would do and drops what makes it parallel:

* each launch region (one ``__global__``) runs after the previous one; inside it, the phases
  between grid syncs run one after the other, each over all blocks in order, so a stage that
  reads another block's result without a grid sync reads poison;
* inside a block, threads run in lock step statement by statement (every statement for all
  threads before the next), which is what the barriers TVM's ThreadSync inserts guarantee;
  statements under thread-dependent control flow, and a ``Bind`` with what follows it, run
  per thread as a unit and may not contain a barrier;
* per-thread locals become arrays over the block's threads; shared memory is per block;
  wmma fragments are per warp, and each wmma intrinsic runs once per warp (see ``_wmma``);
  a cross-thread reduction (``tvm_thread_allreduce``) combines the values of its group of
  threads in thread order;
* every output and every shared/local buffer is filled with NaN before it is written.

What its numerics cannot catch: warp-level timing (it never runs two threads at once),
memory-model races that a real GPU would expose (a read of another thread's global write
inside one phase sees it here, as if fenced), and intra-block barrier placement (lock step
needs none). The race checker (``runtime.races``, the ``probe`` hooks) sees those conflicts in
the accesses, in any block and thread order. V4's prefetch loops are dropped, or recorded and
checked (``runtime.prefetch_probe``). docs/emulator.md has examples."""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import s_tir, tirx

from ..errors import EmulationError
from ..te.rewrite import dtype_of
from ..stitch.dependence import ATOMIC_ADD
from ..stitch.kernel_ir import is_grid_sync, op_name, strip_prefetch
from ..stitch.lower import launch_form
from ..stitch.rolling import unroll
from . import vectors
from .lockstep import I64, Block, as64, cast, i64, poison, sequence

def _peel(region) -> tuple[dict, dict, tirx.Stmt]:
    """Launch attributes off the top of a region; virtual threads become serial loops."""
    blocks, threads, vthreads = {}, {}, []
    node = region
    while isinstance(node, tirx.AttrStmt) and node.attr_key in ("thread_extent", "virtual_thread"):
        iv = node.node
        tag = str(iv.thread_tag)
        if node.attr_key == "virtual_thread":
            vthreads.append((iv.var, node.value))
        else:
            (blocks if tag.startswith("blockIdx") else threads)[tag] = (iv.var, int(node.value))
        node = node.body
    for var, ext in reversed(vthreads):
        node = tirx.For(var, tirx.const(0, dtype_of(var)), ext if dtype_of(ext) == dtype_of(var) else tirx.Cast(dtype_of(var), ext),
                        tirx.ForKind.SERIAL, node)
    return blocks, threads, node


def _launch(region, reverse: bool = False, probe=None, prefetches=None) -> tirx.Stmt:
    """One ``__global__``: its phases in order, each over every block (last block first when
    ``reverse``: a read of an *earlier* block's result without a grid sync then reads poison)."""
    blocks, threads, body = _peel(region)
    order = [threads[k] for k in ("threadIdx.x", "threadIdx.y", "threadIdx.z") if k in threads]
    thread_vars, stride = {}, 1
    for var, ext in order:
        thread_vars[var] = (stride, ext)
        stride *= ext
    n_threads = max(stride, 1)
    seq = list(body.seq) if isinstance(body, tirx.SeqStmt) else [body]
    # Shared buffers allocated for the whole kernel (resident channels) outlive its grid syncs:
    # one copy per block, poisoned once, before the first phase.
    kept = [s for s in seq if isinstance(s, tirx.AllocBuffer) and str(s.buffer.ty.storage_scope).startswith("shared")]
    seq = [s for s in seq if not any(s.same_as(k) for k in kept)]
    resident, head = _resident(kept, blocks, probe)
    phases, cur = [], []
    for s in seq:
        if is_grid_sync(s):
            phases.append(cur)
            cur = []
        else:
            cur.append(s)
    phases.append(cur)
    out, tables = [], {}
    for phase in phases:
        def block(phase=phase):
            emu = Block(thread_vars, n_threads, probe, resident).run(sequence(phase))
            return emu if prefetches is None else prefetches.phase(emu)
        if probe is not None:                   # blocks in the run's order (a table filled at run time)
            out.append(probe.phase(blocks, block))
            continue
        emu = block()
        # fresh block loop variables per phase: one definition each
        fresh = {var: tirx.Var(var.name, dtype_of(var)) for var, _ in blocks.values()}
        emu = tvm_ffi.structural_map(emu, (tirx.Var, lambda v: fresh.get(v, v)))
        for tag in ("blockIdx.x", "blockIdx.y", "blockIdx.z"):
            if tag in blocks:
                var, ext = blocks[tag]
                if reverse:
                    if tag not in tables:
                        tables[tag] = _descending(var, ext)
                    table = tables[tag][0]
                    down = tirx.Var(var.name + "_down", dtype_of(var))
                    emu = tvm_ffi.structural_map(emu, (tirx.Var, lambda v, f=fresh[var], d=down, t=table:
                                                      tirx.BufferLoad(t, [d]) if v.same_as(f) else v))
                    fresh[var] = down
                emu = tirx.For(fresh[var], tirx.const(0, dtype_of(var)), tirx.const(ext, dtype_of(var)), tirx.ForKind.SERIAL, emu)
        out.append(emu)
    for table, fill in tables.values():
        head += [tirx.AllocBuffer(table), fill]
    return sequence(head + out)


def _descending(var, ext: int) -> tuple[tirx.Buffer, tirx.Stmt]:
    """The block indices last to first, which a reversed phase reads its block index from: not
    ``ext - 1 - down``, which TVM 0.27's FlattenBuffer miscompiles under a floordiv (``(127 - b) // 8``
    becomes ``b // -8 + 15``; docs/tvm-workarounds.md)."""
    table = tirx.decl_buffer([i64(ext)], dtype_of(var), f"{var.name}_descending", scope="global")
    i = tirx.Var("i", I64)
    fill = tirx.For(i, i64(0), i64(ext), tirx.ForKind.SERIAL,
                    tirx.BufferStore(table, cast(dtype_of(var), i64(ext - 1) - i), [i]))
    return table, fill


def _resident(allocs: list, blocks: dict, probe) -> tuple[dict, list]:
    """Per kernel-wide shared buffer: (its per-block copies, the flat block index), and the
    statements that allocate and poison them."""
    order = [blocks[t] for t in ("blockIdx.x", "blockIdx.y", "blockIdx.z") if t in blocks]
    flat, stride, count = i64(0), 1, 1
    for var, ext in order:
        flat = flat + as64(var) * i64(stride)
        stride *= ext
        count *= ext
    out, head = {}, []
    for a in allocs:
        ty = a.buffer.ty
        new = tirx.decl_buffer([i64(count)] + list(ty.shape), ty.dtype, f"{a.buffer.name}_resident", scope="global")
        out[a.buffer] = (new, flat)
        if probe is not None:
            probe.shared(new)
        head.append(tirx.AllocBuffer(new))
        fill = poison(new)
        if fill is not None:
            head.append(fill)
    return out, head


def _written_params(func: tirx.PrimFunc) -> list:
    stored = []
    tvm_ffi.structural_walk(func.body, (tirx.BufferStore, lambda s: stored.append(s.buffer)))
    return [p for p in func.params if any(p.same_as(b) for b in stored)]


def _atomics_in_order(node):
    """``atomicAdd(&buf[i], v)`` becomes ``buf[i] = buf[i] + v``: threads run one after another
    here, so the additions happen in thread order (one of the orders a GPU may pick)."""
    def conv(ev):
        call = ev.value
        if op_name(call) != ATOMIC_ADD:
            return ev
        target = call.args[0].args[0]
        return tirx.BufferStore(target.source, tirx.BufferLoad(target.source, list(target.indices)) + call.args[1],
                                list(target.indices))
    return tvm_ffi.structural_map(node, (tirx.Evaluate, conv))


def emulate_primfunc(func: tirx.PrimFunc, target: tvm.target.Target, name: str = "kernel",
                     reverse: bool = False, probe=None, prefetches=None) -> tirx.PrimFunc:
    """A CPU PrimFunc with the GPU semantics of ``func`` (a scheduled PrimFunc or a stitched kernel);
    ``reverse`` runs each phase's blocks last to first. ``probe`` (``race_probe.Probe``, used by
    ``runtime.races``) adds the race checker: orders chosen at run time, every access checked;
    (``traffic_probe.TrafficProbe``, used by ``runtime.traffic``) the traffic counter.
    V4's prefetch loops are dropped, or with ``prefetches`` (``prefetch_probe.PrefetchProbe``)
    run as records of the lines they name, next to the lines each phase reads of those buffers."""
    func = strip_prefetch(func) if prefetches is None else prefetches.mark(func)
    low = vectors.as_built(launch_form(unroll(func, fresh=True), target, name), target)
    if prefetches is not None:
        prefetches.lowered(low)
    if probe is not None:
        low = probe.prepare(low, target)
    low = tirx.PrimFunc(low.params, _atomics_in_order(low.body), attrs=low.attrs)
    top = list(low.body.seq) if isinstance(low.body, tirx.SeqStmt) else [low.body]
    body = []
    for p in _written_params(low):
        fill = poison(p)
        if fill is not None:
            body.append(fill)
    for item in top:
        if isinstance(item, tirx.AllocBuffer):
            body.append(item)
            fill = poison(item.buffer)
            if fill is not None:
                body.append(fill)
        elif isinstance(item, tirx.AttrStmt) and item.attr_key == "thread_extent":
            if probe is not None:
                probe.launch()
            body.append(_launch(item, reverse, probe, prefetches))
        elif isinstance(item, tirx.Evaluate) and isinstance(item.value, tirx.IntImm):
            continue                # nothing to run (a function that writes only empty tensors)
        else:
            raise EmulationError(f"{name}: a statement outside any launch region ({type(item).__name__})")
    if probe is not None:
        body = probe.wrap(body)
    if prefetches is not None:
        body = prefetches.wrap(body)
    attrs = {k: v for k, v in (low.attrs.items() if low.attrs else []) if k not in ("target", "tirx.is_scheduled")}
    attrs.update({"global_symbol": name, "tirx.noalias": True})
    # Under a root block, as TVM's passes expect of a function not yet lowered (Relax's reshape
    # detection reads the root block of every function it is shown, and fails without one).
    root = s_tir.SBlockRealize([], True, s_tir.SBlock([], [], [], "root", sequence(body)))
    return tirx.PrimFunc(low.params, root, attrs=tvm.ir.DictAttrs(attrs))


def emulate_module(mod: tvm.IRModule, target: tvm.target.Target, reverse: bool = False) -> tvm.IRModule:
    """Every PrimFunc of a CUDA-scheduled module replaced by its CPU emulation (Relax ``main`` kept)."""
    out = {}
    for gv, f in mod.functions.items():
        out[gv] = emulate_primfunc(f, target, gv.name_hint, reverse) if isinstance(f, tirx.PrimFunc) else f
    return tvm.IRModule(out, attrs=mod.attrs)
