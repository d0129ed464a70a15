"""Per-group schedules: TVM's dlight rules on CUDA; the plain loop nest on llvm (the CPU twin).

Rules are tried in dlight's order (Matmul, GEMV, Reduction, GeneralReduction, Fallback); a
rule that raises on a fused group is skipped like one that does not match, so the result
says *which* rule scheduled the group. The partitioner compares that with the rule its anchor
gets alone: fusing must not degrade a tiled GEMM to the fallback schedule.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import tvm
from tvm import tirx

from ..core import tir_stats
from ..errors import ScheduleError, SouffleError
from ..te.rewrite import cast_like, variables
from ..core.ir_names import ATOMIC_ATTR, TILE_ATTR
from ..core.geometry import MATMUL_K_TILE, MATMUL_MICRO, MATMUL_THREADS, MATMUL_TILE, STATIC_SHARED_LIMIT
from ..core.targets import is_cuda


@dataclass
class Scheduled:
    func: tirx.PrimFunc
    rule: str          # the dlight rule that applied ("none" on llvm)
    notes: str = ""    # rules that raised before one applied


# How much of the hardware a rule's schedule uses; fusing must not lower it.
RANK = {"database": 3, "Matmul": 3, "TensorCoreMatmul": 3, "PartialRows": 2, "AtomicRows": 2, "GEMV": 2, "Reduction": 2,
        "ColumnReduction": 2, "GeneralReduction": 2, "Fallback": 0, "none": 0}


def _rules(block_size: int | None, gemm_k_tile: int | None = None):
    from tvm.s_tir import dlight as dl

    if block_size is None:
        return [dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(), dl.gpu.Fallback()]
    # One block size for every stage of a stitched kernel: rules whose thread count is fixed
    # by the rule itself (GEMV, Reduction) are left out.
    if block_size != 256:
        raise ScheduleError(f"stitched stages are scheduled with 256 threads (asked: {block_size})")
    from .tensorcore import TensorCoreMatmul

    return [AtomicRows(), PartialRows(), TensorCoreMatmul(), _Matmul256(gemm_k_tile or MATMUL_K_TILE),
            ColumnReduction(block_size), dl.gpu.GeneralReduction(), dl.gpu.Fallback()]


class ColumnReduction:
    """A reduction over an outer axis: x·W with W laid out [K, N] (the LSTM's recurrent GEMV,
    MMoE's experts at batch 1), which dlight's GEMV and Reduction rules leave to the Fallback
    at 256 threads: one output per thread, a serial loop over K, N / 256 blocks.

    Here each block makes ``tx`` outputs across threadIdx.x, reading W's rows coalesced, and
    splits K ``ty`` ways over threadIdx.y (``rfactor`` into shared memory), the partial sums
    then added per output: ``tx * ty`` = the stitched block size, N / ``tx`` blocks. dlight's
    Reduction rule does the same for its "inner spatial" case with its own thread counts."""

    SHAPES = ((16, 16), (32, 8), (8, 32), (64, 4), (4, 64))     # (tx, ty), dlight's first

    def __init__(self, block_size: int):
        self.block_size = block_size

    def apply(self, func, target, _tune):
        from tvm import s_tir

        sch = s_tir.Schedule(func)
        blocks = sch.get_child_blocks(sch.get_sblock("root"))
        if len(blocks) != 1:
            return None
        block = sch.get(blocks[0])
        spatial = [iv for iv in block.iter_vars if iv.iter_type == 0]
        reduce = [iv for iv in block.iter_vars if iv.iter_type == 2]
        if len(reduce) != 1 or not spatial or len(block.iter_vars) != len(spatial) + 1 or len(block.writes) != 1:
            return None
        # the column case: the largest input is indexed by the reduction axis, and innermost by a
        # spatial one (an inner reduction is dlight's, at any thread count)
        big = max(block.reads, key=lambda r: math.prod(int(d) for d in r.source.ty.shape))
        inner = variables(big.region[-1].min)
        if not any(v.same_as(reduce[0].var) for r in big.region for v in variables(r.min)) or \
                not inner or any(v.same_as(reduce[0].var) for v in inner):
            return None
        loops = sch.get_loops(blocks[0])
        if len(loops) != len(block.iter_vars):
            return None
        points = math.prod(int(iv.dom.extent) for iv in spatial)
        k = int(reduce[0].dom.extent)
        shape = next(((tx, ty) for tx, ty in self.SHAPES if tx * ty == self.block_size and points % tx == 0
                      and k % ty == 0), None)
        if shape is None:
            return None
        tx_n, ty_n = shape
        if not _trivially_bound(func, [sch.get(lp).loop_var for lp in loops]):
            return None
        s_loops = [lp for lp, iv in zip(loops, block.iter_vars) if iv.iter_type == 0]
        r_loops = [lp for lp, iv in zip(loops, block.iter_vars) if iv.iter_type == 2]
        sch.reorder(*s_loops, r_loops[0])
        fused = sch.fuse(*s_loops)
        sch.split(fused, [None, tx_n])
        _, ty = sch.split(r_loops[0], [None, ty_n])
        rf = sch.rfactor(ty, 0)
        bx, tx, ro, ty, *_ = sch.get_loops(rf)
        sch.reorder(bx, tx, ty, ro)
        sch.bind(bx, "blockIdx.x")
        sch.bind(tx, "threadIdx.x")
        sch.bind(ty, "threadIdx.y")
        sch.set_scope(rf, 0, "shared")
        sch.decompose_reduction(rf, ro)
        # The write-back sums each output's ty partials from shared memory in a serial loop. A
        # cross-thread reduction over threadIdx.y alone would be shorter, but TVM lowers it only
        # where threadIdx.y is a launch dimension of its own, which a stitched stage's is not
        # (its threads are one threadIdx.x of the kernel's 256). Every threadIdx.y row does the
        # same sums, each in its own register, and stores the same value: no race.
        store = sch.cache_write(blocks[0], 0, "local")
        sch.reverse_compute_at(blocks[0], bx, preserve_unit_loops=True)
        _, r, *s_rest = sch.get_loops(blocks[0])
        s_wb = sch.fuse(*s_rest) if len(s_rest) > 1 else s_rest[0]
        sch.reorder(s_wb, r)
        sch.bind(s_wb, "threadIdx.x")
        sch.reverse_compute_at(store, s_wb)
        return sch


def _trivially_bound(func: tirx.PrimFunc, loop_vars: list) -> bool:
    """Is the (only) block's i-th iterator the i-th loop's variable (TE's form)?"""
    import tvm_ffi
    from tvm import s_tir

    realizes: list = []
    tvm_ffi.structural_walk(func.body, (s_tir.SBlockRealize, lambda r: realizes.append(r)))
    values = [r for r in realizes if r.block.name_hint != "root"]
    return len(values) == 1 and len(values[0].iter_values) == len(loop_vars) and \
        all(isinstance(v, tirx.Var) and v.same_as(lv) for v, lv in zip(values[0].iter_values, loop_vars))




class PartialRows:
    """The first phase of a two-phase reduction (``transforms.two_phase``), laid out like the
    GEMM that feeds it: block (x = row tile, y = the leading axes fused with the column tile),
    one thread per row of the tile, the tile's columns reduced serially. Each block then reads
    exactly the tile the same-numbered GEMM block wrote, which the stitcher can prove."""

    def apply(self, func, target, _tune):
        from tvm import s_tir

        sch = s_tir.Schedule(func)
        blocks = sch.get_child_blocks(sch.get_sblock("root"))
        tiles = {int(sch.get(b).annotations.get(TILE_ATTR, 0)) for b in blocks}
        if len(tiles) != 1 or 0 in tiles or any(ATOMIC_ATTR in sch.get(b).annotations for b in blocks):
            return None
        (tile,) = tiles
        *lead, rows, col, red = sch.get_loops(blocks[0])
        ro, ri = sch.split(rows, [None, tile])
        sch.reorder(ro, *lead, col, ri, red)
        by = sch.fuse(*lead, col) if lead else col
        sch.bind(ro, "blockIdx.x")
        sch.bind(by, "blockIdx.y")
        sch.bind(ri, "threadIdx.x")
        for b in blocks[1:]:     # later partials of the same rows: same threads, same loop
            sch.reverse_compute_at(b, ri)
        return sch


class AtomicRows:
    """The atomic form of a two-phase row sum (``two_phase(..., atomic=True)``), written as
    launch-form TIR (no schedule primitive binds a reduction to blocks): a zero fill of the row
    results, then blocks laid out like ``PartialRows`` each sum their tile's slice of a row in a
    register and ``atomicAdd`` it into the row's result. The stitcher hoists the zero fill to
    the kernel's start and orders the additions before any reader with a grid sync."""

    def apply(self, func, target, _tune):
        import tvm_ffi
        from tvm import s_tir

        realizes = []
        tvm_ffi.structural_walk(func.body, (s_tir.SBlockRealize, lambda r: realizes.append(r)))
        realizes = [r for r in realizes if r.block.name_hint != "root"]
        if not realizes or not all(ATOMIC_ATTR in (r.block.annotations or {}) for r in realizes):
            return None
        first = realizes[0].block
        tile = int(first.annotations[TILE_ATTR])
        spatial = [iv for iv in first.iter_vars if int(iv.iter_type) == 0]
        reduce = [iv for iv in first.iter_vars if int(iv.iter_type) == 2]
        if len(reduce) != 1 or not spatial:
            return None
        ext = [int(iv.dom.extent) for iv in spatial]
        k_ext = int(reduce[0].dom.extent)
        if ext[-1] % tile or k_ext % tile:
            return None
        lead = math.prod(ext[:-1])
        i32 = lambda v: tirx.const(v, "int32")  # noqa: E731

        def launch(tag, var, n, body):
            return tirx.AttrStmt(tirx.IterVar(tvm.ir.Range(i32(0), i32(n)), var, 1, tag), "thread_extent", i32(n), body)

        def coords(flat, dims):            # row-major: the last dimension moves fastest
            out = []
            for d in reversed(dims):
                out.append(tirx.floormod(flat, i32(d)))
                flat = tirx.floordiv(flat, i32(d))
            return list(reversed(out))

        # 1. zero fill of every row result
        total, zx, zt = math.prod(ext), tirx.Var("blockIdx_x", "int32"), tirx.Var("threadIdx_x", "int32")
        flat = zx * i32(256) + zt
        where = coords(flat, ext)
        zeros = [tirx.BufferStore(r.block.body.buffer, tirx.const(0, str(r.block.body.buffer.ty.dtype)), where)
                 for r in realizes]
        zero = launch("blockIdx.x", zx, -(-total // 256), launch("threadIdx.x", zt, 256,
                      tirx.IfThenElse(flat < i32(total), tirx.SeqStmt(zeros) if len(zeros) > 1 else zeros[0], None)))
        # 2. per tile: a register sum, one atomicAdd per row
        bx, by, tx = tirx.Var("blockIdx_x", "int32"), tirx.Var("blockIdx_y", "int32"), tirx.Var("threadIdx_x", "int32")
        kk = tirx.Var("kk", "int32")
        parts = k_ext // tile
        row = [*coords(tirx.floordiv(by, i32(parts)), ext[:-1]), bx * i32(tile) + tx]
        k = tirx.floormod(by, i32(parts)) * i32(tile) + kk
        body = []
        for r in realizes:
            blk = r.block
            store = blk.body
            value = store.value.b if _is_load_of(store.value.a, store.buffer) else store.value.a
            vmap = {iv.var: cast_like(c, iv.var) for iv, c in zip([iv for iv in blk.iter_vars if int(iv.iter_type) == 0], row)}
            vmap[[iv for iv in blk.iter_vars if int(iv.iter_type) == 2][0].var] = cast_like(k, reduce[0].var)
            value = tvm_ffi.structural_map(value, (tirx.Var, lambda v: vmap.get(v, v)))
            dtype = str(store.buffer.ty.dtype)
            acc = tirx.decl_buffer([1], dtype, f"{blk.name_hint}_acc", scope="local")
            body += [tirx.AllocBuffer(acc), tirx.BufferStore(acc, tirx.const(0, dtype), [i32(0)]),
                     tirx.For(kk, i32(0), i32(tile), tirx.ForKind.SERIAL,
                              tirx.BufferStore(acc, tirx.BufferLoad(acc, [i32(0)]) + value, [i32(0)])),
                     tirx.Evaluate(tvm.backend.cuda.op.cuda_atomic_add(
                         tirx.address_of(tirx.BufferLoad(store.buffer, row)), tirx.BufferLoad(acc, [i32(0)])))]
        adds = launch("blockIdx.x", bx, ext[-1] // tile, launch("blockIdx.y", by, lead * parts,
                      launch("threadIdx.x", tx, tile, tirx.SeqStmt(body))))
        out = tirx.PrimFunc(func.params, tirx.SeqStmt([zero, adds]), attrs=func.attrs)
        return _Done(out.with_attr("tirx.is_scheduled", True))


class _Done:
    """A rule's result that is already a function (what ``schedule_group`` reads off a Schedule)."""

    def __init__(self, func):
        self.mod = {"main": func}


def _is_load_of(expr, buf) -> bool:
    return isinstance(expr, tvm.ir.TensorLoad) and expr.source.same_as(buf)


@functools.cache
def _matmul256_class():
    from tvm.s_tir import dlight as dl

    class Matmul256(dl.gpu.Matmul):
        """dlight's GEMM schedule with a 16x16 thread block (dlight's own CUDA choice is 8x16)
        and a chosen K tile. Tiles past the 48 KB a kernel may declare statically go to
        dynamic shared memory (``shared.dyn``), which TVM's runtime opts in for at launch."""

        def __init__(self, k_tile: int = MATMUL_K_TILE):
            super().__init__()
            self.k_tile = k_tile

        def get_configs(self, target):
            config = super().get_configs(target)
            config.block_size_x = config.block_size_y = MATMUL_THREADS
            config.micro_size_x = config.micro_size_y = MATMUL_MICRO
            config.vthread_x = config.vthread_y = 1
            config.micro_size_k = self.k_tile
            return config

        def apply(self, func, target, tune):
            sch = super().apply(func, target, tune)
            if sch is None or isinstance(sch, list):
                return sch
            shared = [b for b in _blocks(sch) if any(str(w.source.ty.storage_scope) == "shared"
                                                     for w in sch.get(b).writes)]
            # Per K step each shared buffer holds a MATMUL_TILE x k_tile tile (the allocations
            # still have the full operand shape here; compaction comes later).
            total = sum(MATMUL_TILE * self.k_tile * tir_stats.dtype_bytes(w.source.ty.dtype)
                        for b in shared for w in sch.get(b).writes)
            if total > STATIC_SHARED_LIMIT:
                for b in shared:
                    sch.set_scope(b, 0, "shared.dyn")
            return sch

    return Matmul256


def _blocks(sch) -> list:
    out = []

    def visit(parent):
        for b in sch.get_child_blocks(parent):
            out.append(b)
            visit(b)
    visit(sch.get_sblock("root"))
    return out


def _Matmul256(k_tile: int = MATMUL_K_TILE):  # noqa: N802
    return _matmul256_class()(k_tile)


def undefined_buffers(func: tirx.PrimFunc) -> list[str]:
    """Names of the buffers ``func`` loads or stores that nothing defines: no parameter, block
    allocation, match_buffer, AllocBuffer or DeclBuffer.

    A correct schedule has none. TVM 0.27's ``reverse_compute_inline`` leaves one behind when
    the producer's buffer has a second consumer: it moves the inlined consumer's store into
    the producer, deletes the buffer's allocation, and the other consumer still reads it.
    Minimal reproducer (``Schedule.reverse_compute_inline`` is accepted, the build fails in
    FlattenBuffer with "Buffer B is used before its definition")::

        @T.prim_func(s_tir=True)
        def f(A: T.Buffer((8,), "float32"), C1: T.Buffer((4,), "float32"), C2: T.Buffer((4,), "float32")):
            B = T.sblock_alloc_buffer((8,), "float32")
            for i in range(8):
                with T.sblock("B"):
                    vi = T.axis.spatial(8, i)
                    B[vi] = A[vi] * T.float32(2)
            for i in range(4):
                with T.sblock("C1"):
                    vi = T.axis.spatial(4, i)
                    C1[vi] = B[vi]
            for i in range(4):
                with T.sblock("C2"):
                    vi = T.axis.spatial(4, i)
                    C2[vi] = B[vi + 4]

        sch = s_tir.Schedule(f); sch.reverse_compute_inline(sch.get_sblock("C1"))
        tvm.compile(sch.mod, "llvm")

    dlight's Matmul rule meets it on a GEMM group whose epilogue ends in several outputs
    (Swin's window reverse + cyclic shift at V0/V1: GEMM -> bias -> reshape/transpose -> two
    strided slices of the same tensor): ``auto_inline_consumer_chain`` reverse-inlines the
    first slice into the GEMM's write-back and the second slice reads a buffer that is gone.
    """
    import tvm_ffi
    from tvm import s_tir

    defined = {p for p in func.params}

    def block(b):
        defined.update(b.alloc_buffers)
        defined.update(m.buffer for m in b.match_buffers)

    tvm_ffi.structural_walk(func.body, (s_tir.SBlock, block))
    tvm_ffi.structural_walk(func.body, (tirx.AllocBuffer, lambda a: defined.add(a.buffer)))
    tvm_ffi.structural_walk(func.body, (tirx.DeclBuffer, lambda d: defined.add(d.buffer)))
    used = {}
    tvm_ffi.structural_walk(func.body, (tvm.ir.TensorLoad, lambda ld: used.setdefault(ld.source, None)))
    tvm_ffi.structural_walk(func.body, (tirx.BufferStore, lambda st: used.setdefault(st.buffer, None)))
    return sorted({str(b.name) for b in used if b not in defined})


def schedule_group(func: tirx.PrimFunc, target: tvm.target.Target, block_size: int | None = None,
                   gemm_k_tile: int | None = None) -> Scheduled:
    """Schedule ``func`` for ``target`` with the first dlight rule that applies.

    ``block_size`` forces every rule to use that many threads per block (stitched kernels);
    ``gemm_k_tile`` sets the stitched GEMMs' K tile (shared tiles over 48 KB become dynamic).
    """
    if not is_cuda(target):
        return Scheduled(func, "none")
    if block_size is not None:
        attrs = dict(target.attrs)
        attrs.update({"kind": "cuda", "max_num_threads": block_size, "max_threads_per_block": block_size})
        attrs.pop("keys", None)
        target = tvm.target.Target(attrs)
    failures = []
    with target:
        for rule in _rules(block_size, gemm_k_tile):
            try:
                sch = rule.apply(func, target, False)
            except Exception as err:  # noqa: BLE001 - a rule's assertion means "does not apply here"
                lines = str(err).strip().splitlines()
                failures.append(f"{type(rule).__name__}: {type(err).__name__} {(lines[-1] if lines else '')[:120]}")
                continue
            if sch is None:
                continue
            if isinstance(sch, list):
                sch = sch[0]
            out = sch.mod["main"].with_attr("tirx.is_scheduled", True)
            name = type(rule).__name__.replace("Matmul256", "Matmul")
            lost = undefined_buffers(out)
            if lost:
                # TVM 0.27 bug (see ``undefined_buffers``): the rule's epilogue inlining dropped a
                # buffer that another output still reads, and FlattenBuffer would fail on it
                # ("used before its definition"). A fixed TVM refuses the inlining, and dlight's
                # rule then raises; do what that would do: the rule does not apply here.
                failures.append(f"{name}: its schedule reads {', '.join(lost)}, which TVM's "
                                f"reverse_compute_inline removed (an epilogue with several outputs)")
                continue
            return Scheduled(out, name, "; ".join(failures))
    raise ScheduleError("no dlight rule schedules it: " + "; ".join(failures))
