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

from ..core.ir_names import STAGE_BLOCKS
from ..errors import EmulationError
from ..te.rewrite import cast_like, dtype_of, uses
from ..stitch.dependence import ATOMIC_ADD
from ..stitch.kernel_ir import BARRIERS, calls_to, is_grid_sync, op_name, strip_prefetch
from ..stitch.lower import launch_form
from ..stitch.rolling import unroll
from . import bind_spans, vectors

_I64 = "int64"
# CUDA warp matrix intrinsics (m = n = k = 16): see _Block._wmma
_WMMA = ("tirx.tvm_fill_fragment", "tirx.tvm_load_matrix_sync", "tirx.tvm_store_matrix_sync", "tirx.tvm_mma_sync")
_WARP, _MNK, _TILE = 32, 16, 256


def _i64(v) -> tirx.PrimExpr:
    return tirx.const(v, _I64)


def _cast(dtype: str, e) -> tirx.PrimExpr:
    return e if dtype_of(e) == dtype else tirx.Cast(dtype, e)


def _as64(e) -> tirx.PrimExpr:
    return _cast(_I64, e)


def _prod(es: list) -> tirx.PrimExpr:
    out = _i64(1)
    for e in es:
        out = out * e
    return out


def _seq(stmts: list) -> tirx.Stmt:
    flat = []
    for s in stmts:
        flat.extend(s.seq if isinstance(s, tirx.SeqStmt) else [s])
    if not flat:
        return tirx.Evaluate(_i64(0))
    return flat[0] if len(flat) == 1 else tirx.SeqStmt(flat)


def _poison(buf, prefix: list | None = None) -> tirx.Stmt | None:
    """Fill a float buffer with NaN (other dtypes are left alone)."""
    ty = buf.ty
    if not str(ty.dtype).startswith(("float", "bfloat")):
        return None
    shape = list(ty.shape)
    loops = [tirx.Var(f"p{i}", _I64) for i in range(len(shape))]
    store = tirx.BufferStore(buf, tirx.const(float("nan"), str(ty.dtype)), list(prefix or []) + loops)
    for v, e in reversed(list(zip(loops, shape))):
        store = tirx.For(v, _i64(0), e if dtype_of(e) == _I64 else tirx.Cast(_I64, e), tirx.ForKind.SERIAL, store)
    return store


class _Block:
    """Lock-step emulation of one thread block's statements."""

    def __init__(self, thread_vars: dict, n_threads: int, probe=None, resident: dict | None = None):
        self.thread_vars = thread_vars          # Var -> (stride, extent) in the flat thread index
        self.n = n_threads
        self.probe = probe                      # the race checker's instrumentation (runtime.race_probe)
        self.locals: dict = {}                  # original local buffer -> per-thread array
        # original shared buffer -> per-block buffer; a kernel-wide one (a resident channel,
        # ``stitch.channel``) -> one copy per block, indexed by the block first
        self.shared: dict = {buf: new for buf, (new, _) in (resident or {}).items()}
        self.prefix: dict = {buf: [block] for buf, (_, block) in (resident or {}).items()}
        self.frags: dict = {}                   # original wmma.* buffer -> per-warp tiles

    # -- per-thread substitution ---------------------------------------------------------------
    def _thread_exprs(self, t) -> dict:
        return {v: tirx.floormod(tirx.floordiv(t, _i64(stride)), _i64(ext)) if stride > 1 else tirx.floormod(t, _i64(ext))
                for v, (stride, ext) in self.thread_vars.items()}

    def per_thread(self, node, t):
        """``node`` as executed by thread ``t``: thread vars and buffers replaced."""
        tmap = self._thread_exprs(t)

        def var(v):
            return cast_like(tmap[v], v) if v in tmap else v

        def load(x):
            if x.source in self.frags:
                raise EmulationError(f"an element access to the wmma fragment {x.source.name}")
            if x.source in self.locals:
                return tirx.BufferLoad(self.locals[x.source], [t] + list(x.indices))
            if x.source in self.shared:
                return tirx.BufferLoad(self.shared[x.source], self.prefix.get(x.source, []) + list(x.indices))
            return x

        def store(s):
            if s.buffer in self.frags:
                raise EmulationError(f"an element access to the wmma fragment {s.buffer.name}")
            if s.buffer in self.locals:
                return tirx.BufferStore(self.locals[s.buffer], s.value, [t] + list(s.indices))
            if s.buffer in self.shared:
                return tirx.BufferStore(self.shared[s.buffer], s.value, self.prefix.get(s.buffer, []) + list(s.indices))
            return s

        node = tvm_ffi.structural_map(node, (tirx.Evaluate, lambda ev: self._wmma(ev.value, t)
                                             if op_name(ev.value) in _WMMA else ev))
        node = tvm_ffi.structural_map(node, [(tvm.ir.TensorLoad, load), (tirx.BufferStore, store)])
        return tvm_ffi.structural_map(node, (tirx.Var, var))

    def for_all_threads(self, stmt) -> tirx.Stmt:
        t = tirx.Var("t", _I64)
        body = vectors.serial(self.per_thread(stmt, t))
        if self.probe is not None:              # threads in the run's order, every access checked
            return self.probe.threads(t, self.n, body)
        return tirx.For(t, _i64(0), _i64(self.n), tirx.ForKind.SERIAL, body)

    # -- lock step -----------------------------------------------------------------------------
    def run(self, stmt) -> tirx.Stmt:
        tv = set(self.thread_vars)
        if isinstance(stmt, tirx.SeqStmt):
            return _seq([self.for_all_threads(_seq(part)) if whole else self.run(part[0])
                         for part, whole in bind_spans.spans(list(stmt.seq))])
        if isinstance(stmt, tirx.AllocBuffer):
            return self._alloc(stmt.buffer)
        if isinstance(stmt, tirx.For) and stmt.kind == tirx.ForKind.VECTORIZED and not calls_to(stmt, BARRIERS):
            # one vector access per thread on the GPU, not a statement per element (the race
            # checker's ThreadSync may put a barrier between a vector's store and load: lock step)
            return self.for_all_threads(stmt)
        if isinstance(stmt, tirx.For) and not uses(stmt.min, tv) and not uses(stmt.extent, tv):
            if self.probe is not None and STAGE_BLOCKS in stmt.annotations:
                self.probe.stage()
            return tirx.For(stmt.loop_var, stmt.min, stmt.extent, tirx.ForKind.SERIAL, self.run(stmt.body))
        if isinstance(stmt, tirx.IfThenElse) and not uses(stmt.condition, tv):
            return tirx.IfThenElse(stmt.condition, self.run(stmt.then_case),
                                   self.run(stmt.else_case) if stmt.else_case is not None else None)
        if isinstance(stmt, tirx.AttrStmt):
            if stmt.attr_key == "reduce_scope":
                red = self._allreduce(stmt)
                return red if self.probe is None else _seq([red, self.probe.after_allreduce(stmt, self.thread_vars)])
            if stmt.attr_key.startswith("pragma_"):     # unroll hints: llvm unrolls what pays
                return self.run(stmt.body)
            if stmt.attr_key in ("thread_extent", "virtual_thread"):
                raise EmulationError("a launch attribute inside a kernel body")
            return tirx.AttrStmt(stmt.node, stmt.attr_key, stmt.value, self.run(stmt.body))
        if isinstance(stmt, tirx.Evaluate) and op_name(stmt.value) == "tirx.tvm_storage_sync":
            # lock step is already synchronised; the race checker starts a new barrier interval
            return tirx.Evaluate(_i64(0)) if self.probe is None else self.probe.barrier()
        if is_grid_sync(stmt):
            raise EmulationError("a grid sync inside a stage loop (only between stages is modelled)")
        if calls_to(stmt, BARRIERS):
            raise EmulationError("a barrier under thread-dependent control flow: "
                                 "some threads would never reach it")
        return self.for_all_threads(stmt)

    def _alloc(self, buf) -> tirx.Stmt:
        ty = buf.ty
        scope = str(ty.storage_scope)
        if scope.startswith("local") or scope == "warp":
            new = tirx.decl_buffer([_i64(self.n)] + list(ty.shape), ty.dtype, f"{buf.name}_per_thread", scope="global")
            self.locals[buf] = new
            fill = _poison(new)
        elif scope.startswith("wmma."):
            numel = 1
            for e in ty.shape:
                numel *= int(e)
            if numel % _TILE:
                raise EmulationError(f"a wmma fragment buffer {buf.name} of {numel} elements (not 16x16 tiles)")
            new = tirx.decl_buffer([_i64((self.n + _WARP - 1) // _WARP), _i64(numel)], ty.dtype, f"{buf.name}_per_warp",
                                   scope="global")
            self.frags[buf] = new
            fill = _poison(new)
        elif scope.startswith("shared"):
            new = tirx.decl_buffer(list(ty.shape), ty.dtype, f"{buf.name}_block", scope="global")
            self.shared[buf] = new
            if self.probe is not None:
                self.probe.shared(new)
            fill = _poison(new)
        else:
            return tirx.AllocBuffer(buf)
        return _seq([tirx.AllocBuffer(new)] + ([fill] if fill is not None else []))

    # -- warp matrix intrinsics ---------------------------------------------------------------
    def _wmma(self, call, t) -> tirx.Stmt:
        """A wmma intrinsic as thread ``t`` sees it (arguments not yet substituted). CUDA has all 32
        lanes of a warp call it with warp-uniform arguments and the fragment belongs to the warp,
        so under lock step one execution per warp is the warp's: lane 0 runs it, as a scalar loop
        nest over 16x16 tiles; fragment ``index`` i is the row-major tile at [i*256, (i+1)*256)
        of the warp's array (matrix_a m x k, matrix_b k x n, accumulator m x n)."""
        name, args = op_name(call), list(call.args)
        if any(int(a.value) != _MNK for a in (args[1:4] if name != "tirx.tvm_mma_sync" else [])):
            raise EmulationError(f"{name} with a fragment shape other than 16x16x16")
        warp = tirx.floordiv(t, _i64(_WARP))
        r, c, k = (tirx.Var(v, _I64) for v in ("wr", "wc", "wk"))

        def frag(data, index, row, col):          # (buffer, indices) of one fragment element
            buf = self.frags.get(data.args[0]) if op_name(data) == "tirx.buffer_data" else None
            if buf is None:
                raise EmulationError(f"{name} on {data}, not a wmma fragment of this block")
            return buf, [warp, _as64(index) * _i64(_TILE) + row * _i64(_MNK) + col]

        def mem(ptr, stride, layout, row, col):   # (buffer, indices) behind tvm_access_ptr(type, data, offset, ...)
            if op_name(ptr) != "tirx.tvm_access_ptr" or op_name(ptr.args[1]) != "tirx.buffer_data":
                raise EmulationError(f"{name} through {ptr}, not a tvm_access_ptr into a buffer")
            buf = ptr.args[1].args[0]
            if dtype_of(ptr.args[0]) != str(buf.ty.dtype):
                raise EmulationError(f"{name} through a {dtype_of(ptr.args[0])} pointer into {buf.name}")
            if str(layout.value) not in ("row_major", "col_major"):
                raise EmulationError(f"{name} with layout {layout.value}")
            lead, minor = (row, col) if str(layout.value) == "row_major" else (col, row)
            flat = _as64(ptr.args[2]) + lead * _as64(stride) + minor
            shape = [_as64(e) for e in buf.ty.shape]
            strides = [_as64(e) for e in buf.ty.strides] or [_prod(shape[i + 1:]) for i in range(len(shape))]
            return buf, [tirx.floordiv(flat if i == 0 else tirx.floormod(flat, strides[i - 1]), strides[i])
                         for i in range(len(shape))]

        def nest(body, loops=(r, c)):
            for v in reversed(loops):
                body = tirx.For(v, _i64(0), _i64(_MNK), tirx.ForKind.SERIAL, body)
            return body

        def put(target, value):
            return tirx.BufferStore(target[0], _cast(str(target[0].ty.dtype), value), target[1])

        if name == "tirx.tvm_fill_fragment":      # (frag, m, n, k, index, value)
            body = nest(put(frag(args[0], args[4], r, c), args[5]))
        elif name == "tirx.tvm_load_matrix_sync":  # (frag, m, n, k, index, ptr, stride, layout)
            body = nest(put(frag(args[0], args[4], r, c), tirx.BufferLoad(*mem(*args[5:8], r, c))))
        elif name == "tirx.tvm_store_matrix_sync":  # the inverse
            body = nest(put(mem(*args[5:8], r, c), tirx.BufferLoad(*frag(args[0], args[4], r, c))))
        else:                                      # mma (D, di, A, ai, B, bi, C, ci): D = A @ B + C
            d = frag(args[0], args[1], r, c)
            acc = str(d[0].ty.dtype)
            prod = (_cast(acc, tirx.BufferLoad(*frag(args[2], args[3], r, k)))
                    * _cast(acc, tirx.BufferLoad(*frag(args[4], args[5], k, c))))
            body = nest(_seq([put(d, tirx.BufferLoad(*frag(args[6], args[7], r, c))),
                              nest(put(d, tirx.BufferLoad(*d) + prod), (k,))]))
        return tirx.IfThenElse(tirx.floormod(t, _i64(_WARP)) == _i64(0), body, None)

    def _stride(self, e) -> int:
        """How far apart in the flat thread index consecutive values of the thread index ``e``
        (a thread var, or one peeled off the flat index: ``t // s``, ``t % m``, ``t // s % m``) are."""
        if isinstance(e, (tirx.FloorMod, tirx.Cast)):
            return self._stride(e.a if isinstance(e, tirx.FloorMod) else e.value)
        if isinstance(e, tirx.FloorDiv) and isinstance(e.b, tirx.IntImm):
            return int(e.b.value) * self._stride(e.a)
        if isinstance(e, tirx.Var) and e in self.thread_vars:
            return self.thread_vars[e][0]
        raise EmulationError(f"a cross-thread reduction over {e}, not a thread index")

    def _allreduce(self, attr: tirx.AttrStmt) -> tirx.Stmt:
        """``tvm_thread_allreduce(size, *values, cond, *outs, *idx)``: every thread of a group gets
        the combination, in thread order, of its group's ``size`` values (ArgMin: index, value)
        where ``cond`` holds. Groups: threads whose flat indices agree once the reduced thread
        dimensions (``idx``, with their strides) are zeroed (``threadIdx.x``: by warp row)."""
        reducer = attr.node
        calls = calls_to(attr.body, ("tirx.tvm_thread_allreduce",))
        if len(calls) != 1 or not isinstance(attr.body, tirx.Evaluate):
            raise EmulationError("an unexpected cross-thread reduction form")
        args = list(calls[0].args)
        size = int(args[0].value)
        values, cond, outs, idx = args[1:1 + size], args[1 + size], args[2 + size:2 + 2 * size], args[2 + 2 * size:]
        if not all(isinstance(out, tvm.ir.TensorLoad) for out in outs):
            raise EmulationError("a cross-thread reduction whose result is not a buffer element")
        # one accumulator per value and group, indexed by the group key t - idx(t) (in [0, n)): O(n)
        acc = [tirx.decl_buffer([_i64(self.n)], dtype_of(v), f"allreduce_acc{j}", scope="global")
               for j, v in enumerate(values)]
        new = [tirx.decl_buffer([_i64(1)], dtype_of(v), f"allreduce_new{j}", scope="global") for j, v in enumerate(values)]

        def key(th):
            # the group of thread th: its flat index with the reduced thread dimensions zeroed
            k = th
            for e in idx:
                k = k - tirx.Cast(_I64, self.per_thread(e, th)) * _i64(self._stride(e))
            return k if idx else _i64(0)

        t = [tirx.Var(f"t{i}", _I64) for i in range(3)]
        operands = [*zip(reducer.lhs, (tirx.BufferLoad(a, [key(t[1])]) for a in acc)),
                    *zip(reducer.rhs, (self.per_thread(x, t[1]) for x in values))]
        combined = [tvm_ffi.structural_map(r, (tirx.Var, lambda v: next((e for k, e in operands if k.same_as(v)), v)))
                    for r in reducer.result]
        # every value combined from the accumulators as they were, then stored
        step = _seq([tirx.BufferStore(b, c, [_i64(0)]) for b, c in zip(new, combined)]
                    + [tirx.BufferStore(a, tirx.BufferLoad(b, [_i64(0)]), [key(t[1])]) for a, b in zip(acc, new)])
        loops = [
            _seq([tirx.BufferStore(a, e, [key(t[0])]) for a, e in zip(acc, reducer.identity_element)]),
            tirx.IfThenElse(self.per_thread(cond, t[1]), step, None),
            _seq([self.per_thread(tirx.BufferStore(out.source, tirx.BufferLoad(a, [key(t[2])]), list(out.indices)), t[2])
                  for a, out in zip(acc, outs)]),
        ]
        return _seq([tirx.AllocBuffer(b) for b in acc + new]
                    + [tirx.For(th, _i64(0), _i64(self.n), tirx.ForKind.SERIAL, body) for th, body in zip(t, loops)])


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
            emu = _Block(thread_vars, n_threads, probe, resident).run(_seq(phase))
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
    return _seq(head + out)


def _descending(var, ext: int) -> tuple[tirx.Buffer, tirx.Stmt]:
    """The block indices last to first, which a reversed phase reads its block index from: not
    ``ext - 1 - down``, which TVM 0.27's FlattenBuffer miscompiles under a floordiv (``(127 - b) // 8``
    becomes ``b // -8 + 15``; docs/tvm-workarounds.md)."""
    table = tirx.decl_buffer([_i64(ext)], dtype_of(var), f"{var.name}_descending", scope="global")
    i = tirx.Var("i", _I64)
    fill = tirx.For(i, _i64(0), _i64(ext), tirx.ForKind.SERIAL,
                    tirx.BufferStore(table, _cast(dtype_of(var), _i64(ext - 1) - i), [i]))
    return table, fill


def _resident(allocs: list, blocks: dict, probe) -> tuple[dict, list]:
    """Per kernel-wide shared buffer: (its per-block copies, the flat block index), and the
    statements that allocate and poison them."""
    order = [blocks[t] for t in ("blockIdx.x", "blockIdx.y", "blockIdx.z") if t in blocks]
    flat, stride, count = _i64(0), 1, 1
    for var, ext in order:
        flat = flat + _as64(var) * _i64(stride)
        stride *= ext
        count *= ext
    out, head = {}, []
    for a in allocs:
        ty = a.buffer.ty
        new = tirx.decl_buffer([_i64(count)] + list(ty.shape), ty.dtype, f"{a.buffer.name}_resident", scope="global")
        out[a.buffer] = (new, flat)
        if probe is not None:
            probe.shared(new)
        head.append(tirx.AllocBuffer(new))
        fill = _poison(new)
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
        fill = _poison(p)
        if fill is not None:
            body.append(fill)
    for item in top:
        if isinstance(item, tirx.AllocBuffer):
            body.append(item)
            fill = _poison(item.buffer)
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
    root = s_tir.SBlockRealize([], True, s_tir.SBlock([], [], [], "root", _seq(body)))
    return tirx.PrimFunc(low.params, root, attrs=tvm.ir.DictAttrs(attrs))


def emulate_module(mod: tvm.IRModule, target: tvm.target.Target, reverse: bool = False) -> tvm.IRModule:
    """Every PrimFunc of a CUDA-scheduled module replaced by its CPU emulation (Relax ``main`` kept)."""
    out = {}
    for gv, f in mod.functions.items():
        out[gv] = emulate_primfunc(f, target, gv.name_hint, reverse) if isinstance(f, tirx.PrimFunc) else f
    return tvm.IRModule(out, attrs=mod.attrs)
