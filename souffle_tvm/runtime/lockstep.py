"""Lock-step emulation of one thread block (``Block``): a launch region's statements run for all
of a block's threads, statement by statement, with per-thread locals, per-block shared memory,
per-warp wmma fragments and NaN-poisoned buffers; the emulator (``runtime.emulate``) runs a
kernel's blocks through it."""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import tirx

from ..core.ir_names import STAGE_BLOCKS
from ..errors import EmulationError
from ..te.rewrite import cast_like, dtype_of, uses
from ..stitch.kernel_ir import BARRIERS, calls_to, is_grid_sync, op_name
from . import bind_spans, vectors

I64 = "int64"
# CUDA warp matrix intrinsics (m = n = k = 16): see Block._wmma
WMMA = ("tirx.tvm_fill_fragment", "tirx.tvm_load_matrix_sync", "tirx.tvm_store_matrix_sync", "tirx.tvm_mma_sync")
_WARP, _MNK, _TILE = 32, 16, 256


def i64(v) -> tirx.PrimExpr:
    return tirx.const(v, I64)


def cast(dtype: str, e) -> tirx.PrimExpr:
    return e if dtype_of(e) == dtype else tirx.Cast(dtype, e)


def as64(e) -> tirx.PrimExpr:
    return cast(I64, e)


def product(es: list) -> tirx.PrimExpr:
    out = i64(1)
    for e in es:
        out = out * e
    return out


def sequence(stmts: list) -> tirx.Stmt:
    flat = []
    for s in stmts:
        flat.extend(s.seq if isinstance(s, tirx.SeqStmt) else [s])
    if not flat:
        return tirx.Evaluate(i64(0))
    return flat[0] if len(flat) == 1 else tirx.SeqStmt(flat)


def poison(buf, prefix: list | None = None) -> tirx.Stmt | None:
    """Fill a float buffer with NaN (other dtypes are left alone)."""
    ty = buf.ty
    if not str(ty.dtype).startswith(("float", "bfloat")):
        return None
    shape = list(ty.shape)
    loops = [tirx.Var(f"p{i}", I64) for i in range(len(shape))]
    store = tirx.BufferStore(buf, tirx.const(float("nan"), str(ty.dtype)), list(prefix or []) + loops)
    for v, e in reversed(list(zip(loops, shape))):
        store = tirx.For(v, i64(0), e if dtype_of(e) == I64 else tirx.Cast(I64, e), tirx.ForKind.SERIAL, store)
    return store


class Block:
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
        return {v: tirx.floormod(tirx.floordiv(t, i64(stride)), i64(ext)) if stride > 1 else tirx.floormod(t, i64(ext))
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
                                             if op_name(ev.value) in WMMA else ev))
        node = tvm_ffi.structural_map(node, [(tvm.ir.TensorLoad, load), (tirx.BufferStore, store)])
        return tvm_ffi.structural_map(node, (tirx.Var, var))

    def for_all_threads(self, stmt) -> tirx.Stmt:
        t = tirx.Var("t", I64)
        body = vectors.serial(self.per_thread(stmt, t))
        if self.probe is not None:              # threads in the run's order, every access checked
            return self.probe.threads(t, self.n, body)
        return tirx.For(t, i64(0), i64(self.n), tirx.ForKind.SERIAL, body)

    # -- lock step -----------------------------------------------------------------------------
    def run(self, stmt) -> tirx.Stmt:
        tv = set(self.thread_vars)
        if isinstance(stmt, tirx.SeqStmt):
            return sequence([self.for_all_threads(sequence(part)) if whole else self.run(part[0])
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
                return red if self.probe is None else sequence([red, self.probe.after_allreduce(stmt, self.thread_vars)])
            if stmt.attr_key.startswith("pragma_"):     # unroll hints: llvm unrolls what pays
                return self.run(stmt.body)
            if stmt.attr_key in ("thread_extent", "virtual_thread"):
                raise EmulationError("a launch attribute inside a kernel body")
            return tirx.AttrStmt(stmt.node, stmt.attr_key, stmt.value, self.run(stmt.body))
        if isinstance(stmt, tirx.Evaluate) and op_name(stmt.value) == "tirx.tvm_storage_sync":
            # lock step is already synchronised; the race checker starts a new barrier interval
            return tirx.Evaluate(i64(0)) if self.probe is None else self.probe.barrier()
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
            new = tirx.decl_buffer([i64(self.n)] + list(ty.shape), ty.dtype, f"{buf.name}_per_thread", scope="global")
            self.locals[buf] = new
            fill = poison(new)
        elif scope.startswith("wmma."):
            numel = 1
            for e in ty.shape:
                numel *= int(e)
            if numel % _TILE:
                raise EmulationError(f"a wmma fragment buffer {buf.name} of {numel} elements (not 16x16 tiles)")
            new = tirx.decl_buffer([i64((self.n + _WARP - 1) // _WARP), i64(numel)], ty.dtype, f"{buf.name}_per_warp",
                                   scope="global")
            self.frags[buf] = new
            fill = poison(new)
        elif scope.startswith("shared"):
            new = tirx.decl_buffer(list(ty.shape), ty.dtype, f"{buf.name}_block", scope="global")
            self.shared[buf] = new
            if self.probe is not None:
                self.probe.shared(new)
            fill = poison(new)
        else:
            return tirx.AllocBuffer(buf)
        return sequence([tirx.AllocBuffer(new)] + ([fill] if fill is not None else []))

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
        warp = tirx.floordiv(t, i64(_WARP))
        r, c, k = (tirx.Var(v, I64) for v in ("wr", "wc", "wk"))

        def frag(data, index, row, col):          # (buffer, indices) of one fragment element
            buf = self.frags.get(data.args[0]) if op_name(data) == "tirx.buffer_data" else None
            if buf is None:
                raise EmulationError(f"{name} on {data}, not a wmma fragment of this block")
            return buf, [warp, as64(index) * i64(_TILE) + row * i64(_MNK) + col]

        def mem(ptr, stride, layout, row, col):   # (buffer, indices) behind tvm_access_ptr(type, data, offset, ...)
            if op_name(ptr) != "tirx.tvm_access_ptr" or op_name(ptr.args[1]) != "tirx.buffer_data":
                raise EmulationError(f"{name} through {ptr}, not a tvm_access_ptr into a buffer")
            buf = ptr.args[1].args[0]
            if dtype_of(ptr.args[0]) != str(buf.ty.dtype):
                raise EmulationError(f"{name} through a {dtype_of(ptr.args[0])} pointer into {buf.name}")
            if str(layout.value) not in ("row_major", "col_major"):
                raise EmulationError(f"{name} with layout {layout.value}")
            lead, minor = (row, col) if str(layout.value) == "row_major" else (col, row)
            flat = as64(ptr.args[2]) + lead * as64(stride) + minor
            shape = [as64(e) for e in buf.ty.shape]
            strides = [as64(e) for e in buf.ty.strides] or [product(shape[i + 1:]) for i in range(len(shape))]
            return buf, [tirx.floordiv(flat if i == 0 else tirx.floormod(flat, strides[i - 1]), strides[i])
                         for i in range(len(shape))]

        def nest(body, loops=(r, c)):
            for v in reversed(loops):
                body = tirx.For(v, i64(0), i64(_MNK), tirx.ForKind.SERIAL, body)
            return body

        def put(target, value):
            return tirx.BufferStore(target[0], cast(str(target[0].ty.dtype), value), target[1])

        if name == "tirx.tvm_fill_fragment":      # (frag, m, n, k, index, value)
            body = nest(put(frag(args[0], args[4], r, c), args[5]))
        elif name == "tirx.tvm_load_matrix_sync":  # (frag, m, n, k, index, ptr, stride, layout)
            body = nest(put(frag(args[0], args[4], r, c), tirx.BufferLoad(*mem(*args[5:8], r, c))))
        elif name == "tirx.tvm_store_matrix_sync":  # the inverse
            body = nest(put(mem(*args[5:8], r, c), tirx.BufferLoad(*frag(args[0], args[4], r, c))))
        else:                                      # mma (D, di, A, ai, B, bi, C, ci): D = A @ B + C
            d = frag(args[0], args[1], r, c)
            acc = str(d[0].ty.dtype)
            prod = (cast(acc, tirx.BufferLoad(*frag(args[2], args[3], r, k)))
                    * cast(acc, tirx.BufferLoad(*frag(args[4], args[5], k, c))))
            body = nest(sequence([put(d, tirx.BufferLoad(*frag(args[6], args[7], r, c))),
                              nest(put(d, tirx.BufferLoad(*d) + prod), (k,))]))
        return tirx.IfThenElse(tirx.floormod(t, i64(_WARP)) == i64(0), body, None)

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
        acc = [tirx.decl_buffer([i64(self.n)], dtype_of(v), f"allreduce_acc{j}", scope="global")
               for j, v in enumerate(values)]
        new = [tirx.decl_buffer([i64(1)], dtype_of(v), f"allreduce_new{j}", scope="global") for j, v in enumerate(values)]

        def key(th):
            # the group of thread th: its flat index with the reduced thread dimensions zeroed
            k = th
            for e in idx:
                k = k - tirx.Cast(I64, self.per_thread(e, th)) * i64(self._stride(e))
            return k if idx else i64(0)

        t = [tirx.Var(f"t{i}", I64) for i in range(3)]
        operands = [*zip(reducer.lhs, (tirx.BufferLoad(a, [key(t[1])]) for a in acc)),
                    *zip(reducer.rhs, (self.per_thread(x, t[1]) for x in values))]
        combined = [tvm_ffi.structural_map(r, (tirx.Var, lambda v: next((e for k, e in operands if k.same_as(v)), v)))
                    for r in reducer.result]
        # every value combined from the accumulators as they were, then stored
        step = sequence([tirx.BufferStore(b, c, [i64(0)]) for b, c in zip(new, combined)]
                    + [tirx.BufferStore(a, tirx.BufferLoad(b, [i64(0)]), [key(t[1])]) for a, b in zip(acc, new)])
        loops = [
            sequence([tirx.BufferStore(a, e, [key(t[0])]) for a, e in zip(acc, reducer.identity_element)]),
            tirx.IfThenElse(self.per_thread(cond, t[1]), step, None),
            sequence([self.per_thread(tirx.BufferStore(out.source, tirx.BufferLoad(a, [key(t[2])]), list(out.indices)), t[2])
                  for a, out in zip(acc, outs)]),
        ]
        return sequence([tirx.AllocBuffer(b) for b in acc + new]
                    + [tirx.For(th, i64(0), i64(self.n), tirx.ForKind.SERIAL, body) for th, body in zip(t, loops)])
