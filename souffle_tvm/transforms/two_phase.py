"""Two-phase reduction: a row reduction fed by a GEMM becomes per-tile partials and a combine.

A reduction over the last axis of a GEMM's output (softmax's max and exp-sum, LayerNorm's sum
and variance) would wait, after a grid sync, for whole rows. Split in two, its first phase
reduces each ``cols``-wide slice of a row — exactly the slice one GEMM thread block wrote
(its ``rows x cols`` output tile, which the GEMM's rule sizes to the grid), so the
stitcher can prove it block-local and drop the grid sync in between — into a partial buffer
``P[..., q]``; after one grid sync, the second phase combines
the partials of a row, one per tile: ``P[..., j]`` reduces columns ``j * cols .. j * cols + cols - 1``.
A tile's row is shared by ``lanes`` threads (``partial_lanes``: the block's threads over the
tile's rows, ``LANES_ATTR``), each reducing every ``lanes``-th column of it; the schedule
(``PartialRows``) adds the lanes' sums in shared memory, so only ``P`` leaves the chip.
Deterministic (a fixed combine order), and exact in real arithmetic:

* ``sum``/``max`` of an expression of the row element: partial sums/maxima, combined the same way;
* ``sum((e - c)^2)`` for a row constant ``c`` (variance about the mean): per tile the sum ``s``
  and the sum of squares about the tile's own mean ``m2``; combined with Chan et al.'s rule
  ``sum_j m2_j + T (s_j/T - c)^2``, stable where ``E[x^2] - c^2`` is not;
* ``sum(exp(e - c))`` (softmax's denominator): per tile the maximum ``m`` and ``sum(exp(e - m))``,
  combined as ``sum_j s_j exp(m_j - c)`` (the online-softmax rescaling).

Any other reduction, or one whose shape does not tile, is left as it was, with the reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import tvm
import tvm_ffi
from tvm import te, tirx

from ..te import analysis, rewrite as te_rewrite
from ..cost import tir_stats
from ..core.geometry import STITCH_BLOCK
from ..core.ir_names import ATOMIC_ATTR, COMBINE_TILE_ATTR, LANES_ATTR, PARTIAL_TAG, ROW_TILE_ATTR, TILE_ATTR
from ..te.program import TEProgram



@dataclass(frozen=True)
class Candidate:
    """A reduction two_phase can split, as a judge sees it: ``rows`` rows of ``length`` elements
    of ``elem_bytes`` each (the row element's GEMM output), the GEMM's ``tile`` (rows, cols),
    ``partials`` partial buffers of ``partial_bytes`` elements it writes per tile (2 for the
    variance and softmax's denominator) and its form."""
    name: str
    form: str
    rows: int
    length: int
    tile: tuple[int, int]
    elem_bytes: int
    partial_bytes: int
    partials: int

    @property
    def lanes(self) -> int:
        """Threads a tile row in the first phase (``partial_lanes``)."""
        return partial_lanes(self.tile)


LANE_COLUMNS = 4      # the fewest columns a lane reduces: fewer, and the lanes' sum in shared memory costs more than it shares


def partial_lanes(tile: tuple[int, int], threads: int = STITCH_BLOCK) -> int:
    """How many threads share a row of a ``(rows, cols)`` GEMM tile in its first phase: the
    block's threads over the tile's rows, where they divide the tile's columns into runs of at
    least ``LANE_COLUMNS``; else 1. Lanes fill the block exactly: their sums meet in shared
    memory behind a ``__syncthreads``, which a stage narrower than the stitched block may not
    hold (``stitch.lower.why_not_stitchable``)."""
    rows, cols = tile
    lanes = threads // rows if 1 < rows <= threads and threads % rows == 0 else 1
    return lanes if lanes > 1 and cols % lanes == 0 and cols // lanes >= LANE_COLUMNS else 1


Judge = Callable[[Candidate], "str | None"]     # None: split it; else why not


@dataclass
class TwoPhaseResult:
    program: TEProgram
    split: dict[str, str] = field(default_factory=dict)     # reduction -> the form it was split in
    kept: dict[str, str] = field(default_factory=dict)      # reduction -> why it was not


def _reducer_kind(op) -> str | None:
    red = op.body[0]
    if not isinstance(red, tirx.Reduce) or len(red.combiner.result) != 1:
        return None
    res = red.combiner.result[0]
    if isinstance(res, tirx.Add):
        return "sum"
    if isinstance(res, tirx.Max):
        return "max"
    return None


def _row_element(expr, axes: list, k) -> bool:
    """Every load in ``expr`` reads the row element (…, k), a per-column vector (k) or a scalar."""
    for t, idx in te_rewrite.loads(expr):
        if not idx:
            continue
        if not (_is_var(idx[-1], k) and
                (len(idx) == 1 or (len(idx) == len(axes) + 1 and all(_is_var(i, a) for i, a in zip(idx, axes))))):
            return False
    return True


def _row_constant(expr, axes: list) -> bool:
    """A single load indexed by the row alone (the max, the mean)."""
    if not te_rewrite.is_load(expr):
        return False
    idx = list(expr.args[1:])
    return len(idx) == len(axes) and all(_is_var(i, a) for i, a in zip(idx, axes))


def _is_var(e, v) -> bool:
    return isinstance(e, tirx.Var) and e.same_as(v) or (isinstance(e, tirx.Cast) and _is_var(e.value, v))


def _gemm_fed(expr, k) -> list[te.Tensor]:
    """The reductions (GEMMs) whose output ``expr`` reads at the reduced column."""
    return [t for t, idx in te_rewrite.loads(expr) if isinstance(t.op, te.ComputeOp)
            and analysis.classify(t.op)[0] == analysis.REDUCTION and idx and _is_var(idx[-1], k)]


GemmTile = Callable[[te.Tensor], "tuple[int, int] | None"]


def _match(op, stages_by_op: dict, gemm_tile: GemmTile) -> tuple:
    """(form, e, c, tile) for a splittable reduction — e the row-element expression, c the row
    constant, tile its GEMM's (rows, cols) block tile — or (None, why, None, None); why is None
    when the stage is no GEMM-fed row reduction."""
    kind = _reducer_kind(op) if len(op.reduce_axis) == 1 and op.num_outputs == 1 else None
    if kind is None:
        return None, None, None, None
    axes = [ax.var for ax in op.axis]
    k = op.reduce_axis[0].var
    src = op.body[0].source[0]
    # softmax's exp-sum reads the kept exp stage: look through it
    if te_rewrite.is_load(src) and src.args[0].op in stages_by_op:
        t = src.args[0]
        if analysis.classify(t.op)[0] == analysis.ONE_TO_ONE and len(src.args) - 1 == len(axes) + 1 \
                and all(_is_var(i, a) for i, a in zip(src.args[1:], axes + [k])):
            src = te_rewrite.body_at(t.op, t.value_index, axes + [k])
    gemms = _gemm_fed(src, k)
    if not gemms:
        return None, None, None, None
    tiles = {gemm_tile(g) for g in gemms}
    if not all(tiles):
        return None, "its GEMM is not scheduled in tiles a partial can share", None, None
    if len(tiles) > 1:
        return None, f"its GEMMs write different tiles {sorted(tiles)}", None, None
    (tile,) = tiles
    if _row_element(src, axes, k):
        return kind, src, None, tile
    if kind == "sum" and isinstance(src, tirx.Mul) and tvm_ffi.structural_equal(src.a, src.b) \
            and isinstance(src.a, tirx.Sub) and _row_element(src.a.a, axes, k) and _row_constant(src.a.b, axes):
        return "sum-sq", src.a.a, src.a.b, tile
    if kind == "sum" and isinstance(src, tvm.ir.Call) and getattr(src.op, "name", "") == "tirx.exp" \
            and isinstance(src.args[0], tirx.Sub) and _row_element(src.args[0].a, axes, k) \
            and _row_constant(src.args[0].b, axes):
        return "sum-exp", src.args[0].a, src.args[0].b, tile
    return None, "its body is not a row element, (e - c)^2 or exp(e - c)", None, None


def _elem_bytes(e) -> int:
    """Bytes of the widest element the row element loads (what a pass over the row reads)."""
    return max((tir_stats.dtype_bytes(t.dtype) for t, _ in te_rewrite.loads(e)), default=4)


def _canonical(e, axes: list, k) -> str:
    """The row-element expression as text over canonical names (loads by tensor identity), so
    two reductions of the same row element share one partial (softmax's max and exp-sum)."""
    vmap = {a: tirx.Var(f"a{i}", a.ty) for i, a in enumerate(axes)}
    vmap[k] = tirx.Var("k", k.ty)
    return str(te_rewrite.substitute(e, vmap, lambda t, idx: tirx.call_extern(
        str(t.dtype), f"load_{t.op.__hash__():x}_{t.value_index}", *idx)))


def _from_sums(s1, q, c_of, k):
    def f(*sp):
        c = c_of(list(sp))
        return q(*sp) - 2.0 * c * s1(*sp) + k * c * c
    return f


def _combine_fn(combine, reducer, parts: int):
    def f(*sp):
        j = te.reduce_axis((0, parts), name="j")
        return reducer(combine(list(sp), j.var), axis=j)
    return f


def two_phase(prog: TEProgram, gemm_tile: GemmTile, atomic: bool = False, judge: Judge | None = None,
              whole: dict | None = None) -> TwoPhaseResult:
    """Split every GEMM-fed row reduction whose row count and row length tile by its GEMM's
    block tile, in at least two partials per row.

    ``gemm_tile(gemm)``: the (rows, cols) output tile one block of the GEMM's schedule writes,
    which a partial can share, or None (the code generator knows; ``planning.partials.gemm_tile``
    asks it). Only those reductions are split: elsewhere a partial would need a grid sync anyway.

    ``judge(candidate)``: None to split a reduction that can be split, else the reason it is
    kept (``planning.partials.split_pays`` asks the latency model); without one, every candidate
    is split.

    ``whole``: op -> why its rows stay whole (a row chain holds them on chip, ``te.chains``):
    those reductions are kept as they are.

    ``atomic`` (CUDA): fp32 sums — and the variance, as ``E[x^2]``-style sums — accumulate
    straight into their row results with ``atomicAdd`` (``ATOMIC_ATTR`` stages, built by
    ``codegen.rules.AtomicRows``) instead of a partial buffer and a combine; the order of the
    additions, hence the rounding, is then not fixed. Max and softmax's exp-sum stay
    deterministic (no float atomic for them)."""

    stages = prog.stages()
    stages_by_op = {t.op: t for t in stages}
    names = analysis.stage_names(stages)
    result = TwoPhaseResult(prog)
    new_of: dict = {}
    partials: dict = {}          # (kind, canonical row element) -> tensor, shared across reductions

    def load_fn(tensor, idx):
        return new_of[tensor.op][tensor.value_index](*idx) if tensor.op in new_of else None

    def atomic_sum(e_of, spatial, K, name: str, key_expr, tile, square: bool = False):
        """A[...] = sum over the row of e (or e^2): a plain reduction in TE, accumulated with
        atomics per GEMM tile on CUDA."""
        kind = "atomic-sq" if square else "atomic-sum"
        if (kind, key_expr) in partials:
            return partials[kind, key_expr]

        def f(*sp):
            kr = te.reduce_axis((0, K), name="k")
            v = e_of(list(sp), kr.var)
            return te.sum(v * v if square else v, axis=kr)

        partials[kind, key_expr] = te.compute(spatial, f, name=name, tag=PARTIAL_TAG,
                                              attrs={TILE_ATTR: tile[1], ROW_TILE_ATTR: tile[0], ATOMIC_ATTR: 1})
        return partials[kind, key_expr]

    def partial(kind: str, e_of, shape, name: str, key_expr, tile, extra=None):
        """P[..., j] = reduce_{kk < cols} of the row element at k = j*cols + kk: tile j's slice of
        the row (``PartialRows`` gives it ``lanes`` threads, lane l the columns l + lanes*i, and
        adds the lanes' partials on chip)."""
        if (kind, key_expr) in partials:
            return partials[kind, key_expr]
        rows, cols = tile

        def f(*idx):
            kk = te.reduce_axis((0, cols), name="kk")
            q = idx[-1]
            kidx = q * tirx.const(cols, str(q.ty)) + kk.var
            value = e_of(list(idx[:-1]), kidx)
            if extra is not None:
                value = extra(list(idx), value)
            return (te.max if kind == "max" else te.sum)(value, axis=kk)

        partials[kind, key_expr] = te.compute(shape, f, name=name, tag=PARTIAL_TAG,
                                              attrs={TILE_ATTR: cols, ROW_TILE_ATTR: rows,
                                                     LANES_ATTR: partial_lanes(tile)})
        return partials[kind, key_expr]

    for t in stages:
        op = t.op
        form, e, c, tile = _match(op, stages_by_op, gemm_tile) if op not in (whole or {}) else (None, whole[op], None, None)
        if form is not None:
            K = int(op.reduce_axis[0].dom.extent)
            spatial = [int(ax.dom.extent) for ax in op.axis]
            rows, cols = tile
            if not spatial or spatial[-1] % rows:
                form, e = None, f"its {spatial[-1] if spatial else 0} rows are not a whole number of {rows}-row GEMM tiles"
            elif K % cols or K // cols < 2:
                form, e = None, f"its rows of {K} are not two or more {cols}-column GEMM tiles"
            elif judge is not None:
                why = judge(Candidate(names[op], form, math.prod(spatial), K, tile, _elem_bytes(e),
                                      tir_stats.dtype_bytes(t.dtype), 1 if form in ("sum", "max") else 2))
                if why is not None:
                    form, e = None, why
        if form is None:
            if e is not None:
                result.kept[names[op]] = e
            if any(x.op in new_of for x in op.input_tensors):
                new_of[op] = te_rewrite.rebuild(op, load_fn)
            continue
        axes = [ax.var for ax in op.axis]
        k = op.reduce_axis[0].var
        dtype = str(t.dtype)
        shape = spatial + [K // cols]

        def e_of(sp, kidx, e=e, axes=axes, k=k):
            vmap = {a: te_rewrite.cast_like(s, a) for a, s in zip(axes, sp)}
            vmap[k] = te_rewrite.cast_like(kidx, k)
            return te_rewrite.substitute(e, vmap, load_fn)

        def c_of(sp, c=c, axes=axes):
            return te_rewrite.substitute(c, {a: te_rewrite.cast_like(s, a) for a, s in zip(axes, sp)}, load_fn)

        # the display name ("T_add_sum#1") keys the record; the new stages' names reach the
        # generated code as buffer names, so they are C identifiers ("T_add_sum_1_partial")
        shown, base = names[op], names[op].replace("#", "_")
        T = tirx.const(float(cols), dtype)        # the elements of one partial
        key = _canonical(e, axes, k)
        if atomic and dtype == "float32" and form in ("sum", "sum-sq"):
            s1 = atomic_sum(e_of, spatial, K, f"{base}_atomic_sum", key, tile)
            if form == "sum":
                new_of[op] = [s1]
            else:   # sum((e - c)^2) = sum(e^2) - 2 c sum(e) + K c^2
                q = atomic_sum(e_of, spatial, K, f"{base}_atomic_sq", key, tile, square=True)
                kf = tirx.const(float(K), dtype)
                new_of[op] = [te.compute(spatial, _from_sums(s1, q, c_of, kf), name=f"{base}_from_sums")]
            result.split[shown] = form + " (atomic)"
            continue
        if form in ("sum", "max"):
            p = partial(form, e_of, shape, f"{base}_partial", key, tile)
            combine = lambda sp, j, p=p: p(*sp, j)  # noqa: E731
            reducer = te.max if form == "max" else te.sum
        elif form == "sum-sq":
            s = partial("sum", e_of, shape, f"{base}_partial_sum", key, tile)
            m2 = partial("m2", e_of, shape, f"{base}_partial_m2", key, tile,
                         extra=lambda idx, v, s=s: (v - s(*idx) / T) * (v - s(*idx) / T))

            def combine(sp, j, s=s, m2=m2, c_of=c_of):
                d = s(*sp, j) / T - c_of(sp)
                return m2(*sp, j) + T * d * d
            reducer = te.sum
        else:   # sum-exp
            m = partial("max", e_of, shape, f"{base}_partial_max", key, tile)
            es = partial("sum-exp", e_of, shape, f"{base}_partial_expsum", key, tile,
                         extra=lambda idx, v, m=m: tirx.exp(v - m(*idx)))

            def combine(sp, j, m=m, es=es, c_of=c_of):
                return es(*sp, j) * tirx.exp(m(*sp, j) - c_of(sp))
            reducer = te.sum

        # the combine knows its GEMM's tile: its consumer can be laid out like the GEMM (TiledCombine)
        new_of[op] = [te.compute(spatial, _combine_fn(combine, reducer, K // cols), name=f"{base}_combine",
                                 attrs={COMBINE_TILE_ATTR: rows * 65536 + cols})]
        result.split[shown] = form
    if not result.split:
        return result

    def remap(x: te.Tensor) -> te.Tensor:
        return new_of[x.op][x.value_index] if x.op in new_of else x

    op_of = {n.op: prog.op_of.get(old, "?") for old, news in new_of.items() for n in news}
    op_of.update({pt.op: "two-phase partial" for pt in partials.values()})
    result.program = prog.derive(remap, op_of={**prog.op_of, **op_of})
    return result
