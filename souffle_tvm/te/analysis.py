"""Global analysis of a TEProgram: what each stage is, and how stages depend on each other.

Kinds follow the paper: a stage without a summed axis is *one-relies-on-one* (element-wise,
reshape, transpose, slice, broadcast, concat pieces); a stage with one is *one-relies-on-many*
(a reduction; GEMM/conv-like contractions are marked compute-intensive); a stage whose index
depends on loaded data is a *gather*; a Relax call kept outside TE is *opaque*. Everything is
read from index expressions, never from operator names (those are shown for people only).

Every edge carries its element-level index map (``tirx.IndexMap`` from the consumer's
iteration variables, reduce axes included, to the producer's indices), its access pattern
and its reuse: how many times one consumer pass reads each producer element it touches.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from dataclasses import dataclass, field

import tvm
import tvm_ffi
from tvm import te, tirx

from . import rewrite as te_rewrite
from ..cost import tir_stats
from .program import TEProgram

ONE_TO_ONE, REDUCTION, GATHER, OPAQUE = "one-to-one", "reduction", "gather", "opaque"


@dataclass
class Edge:
    producer: str
    index_map: str
    pattern: str          # identity | broadcast | permute | remap | slice | gather | reduce-read | other
    reuse: float


@dataclass
class StageInfo:
    name: str
    op: str               # the Relax op it came from (for people; not used by any decision)
    kind: str
    detail: str
    compute_intensive: bool
    shape: list[int]
    dtype: str
    flops: int
    bytes: int
    consumers: int
    edges: list[Edge] = field(default_factory=list)
    note: str = ""


@dataclass
class Analysis:
    stages: list[StageInfo]

    def counts(self) -> dict[str, int]:
        c = Counter(s.kind for s in self.stages)
        c["compute-intensive"] = sum(s.compute_intensive for s in self.stages)
        return dict(c)

    def detail_counts(self) -> dict[str, int]:
        return dict(Counter(f"{s.kind}/{s.detail}" for s in self.stages))

    def to_json(self) -> dict:
        from dataclasses import asdict

        return {"counts": self.counts(), "detail_counts": self.detail_counts(),
                "stages": [asdict(s) for s in self.stages]}

    def table(self, max_rows: int = 60) -> str:
        lines = [f"{len(self.stages)} stages: " + ", ".join(f"{k} {v}" for k, v in sorted(self.counts().items())),
                 "", f"{'stage':<28} {'op':<18} {'kind':<11} {'detail':<13} {'shape':<18} {'flops':>8} "
                     f"{'bytes':>8} {'uses':>4}  reads"]
        for s in self.stages[:max_rows]:
            reads = "; ".join(f"{e.producer}:{e.pattern}" + (f"x{e.reuse:g}" if e.reuse > 1 else "") for e in s.edges)
            lines.append(f"{s.name[:28]:<28} {s.op[:18]:<18} {s.kind:<11} {s.detail:<13} "
                         f"{'x'.join(map(str, s.shape))[:18]:<18} {s.flops:>8} {s.bytes:>8} {s.consumers:>4}  {reads[:90]}")
        if len(self.stages) > max_rows:
            lines.append(f"... {len(self.stages) - max_rows} more stages (see the JSON)")
        return "\n".join(lines)


# -- helpers --------------------------------------------------------------------------------------
def _ints(shape) -> list[int]:
    return [int(d.value) if hasattr(d, "value") else int(d) for d in shape]


def tensor_bytes(t: te.Tensor) -> int:
    return math.prod(_ints(t.shape)) * tir_stats.dtype_bytes(t.dtype)


def iter_vars(op: te.ComputeOp) -> list:
    return list(op.axis) + list(op.reduce_axis)


_extent = tir_stats.extent


def stage_flops(op: te.ComputeOp) -> int:
    """Useful float operations: instances × (ops in the body [+ 1 combine per reduction step])."""
    total = 0
    spatial = math.prod(_extent(ax) for ax in op.axis)
    for body in op.body:
        if isinstance(body, tirx.Reduce):
            red = math.prod(_extent(rv) for rv in body.axis)
            ops = sum(tir_stats.expr_flops(s) for s in body.source) + 1
            total += spatial * red * ops
        else:
            total += spatial * tir_stats.expr_flops(body)
    return total // max(len(op.body), 1) if len(op.body) > 1 else total


def _simplified(op: te.ComputeOp, indices: list) -> tuple[list, list]:
    ivs = iter_vars(op)
    ana = tvm.sym.Analyzer()
    for iv in ivs:
        ana.bind(iv.var, iv.dom)
    return ivs, [te_rewrite.simplify(ana, i) for i in indices]


def index_map_text(op: te.ComputeOp, indices: list) -> str:
    """One load's index map as text, ``i, j: (j, i)`` (what ``analyze`` shows)."""
    ivs, idx = _simplified(op, indices)
    text = str(tirx.IndexMap([iv.var for iv in ivs], idx, None)).replace("T.index_map(lambda ", "")
    return text[:-1] if text.endswith(")") else text   # only index_map's own paren: the tuple keeps its ")"


def access_pattern(op: te.ComputeOp, producer: te.Tensor, indices: list) -> tuple[str, float]:
    """(pattern, reuse) of one load of ``producer`` by ``op``."""
    ivs, idx = _simplified(op, indices)
    dom = {iv.var: iv.dom for iv in ivs}
    if any(te_rewrite.loads(i) for i in idx):
        return "gather", 1.0
    used = tir_stats.vars_in(*idx) & set(dom)
    iters = math.prod(_extent(iv) for iv in ivs)
    used_ext = math.prod(_extent(iv) for iv in ivs if iv.var in used)
    injective = not used or bool(tvm.sym.detect_iter_map(idx, {v: dom[v] for v in used},
                                                         check_level="bijective").indices)
    reuse = iters / max(used_ext, 1) if injective else float(iters) / max(math.prod(_ints(producer.shape)), 1)
    reduce_vars = {rv.var for rv in op.reduce_axis}
    # Unit axes simplify to constant 0; compare the remaining (moving) axes only.
    axes = [ax.var for ax in op.axis if _extent(ax) > 1]
    var_idx = [i for i in idx if isinstance(i, tirx.Var)]
    p_numel, c_numel = math.prod(_ints(producer.shape)), math.prod(_extent(ax) for ax in op.axis)
    only_vars_or_consts = all(isinstance(i, (tirx.Var, tirx.IntImm)) for i in idx)
    if used & reduce_vars:
        pattern = "reduce-read"
    elif only_vars_or_consts and var_idx == axes and p_numel == c_numel:
        pattern = "identity"
    elif only_vars_or_consts and p_numel == c_numel and sorted(map(str, var_idx)) == sorted(map(str, axes)):
        pattern = "permute"
    elif p_numel < c_numel and only_vars_or_consts:
        pattern = "broadcast"
    elif injective and p_numel == c_numel:
        pattern = "remap"
    elif injective and p_numel > c_numel:
        pattern = "slice"
    else:
        pattern = "other"
    return pattern, reuse


def _is_concat(op: te.ComputeOp) -> bool:
    """Pieces of several tensors chosen by position (topi's concatenate: if_then_else / Select)."""
    found = []
    tvm_ffi.structural_walk(op.body[0], [
        # TVM 0.27 names it "prim.if_then_else" (no longer "tir."): match the suffix
        (tvm.ir.Call, lambda c: found.append(1) if getattr(c.op, "name", "").endswith(".if_then_else") else None),
        (tirx.Select, lambda _: found.append(1))])
    return bool(found)


def selects_among_loads(op: te.ComputeOp) -> bool:
    """Whether each element is one of several loads chosen by position (a concatenation, a
    cyclic shift's two slices): composed into a consumer, it reads its producers through
    several index patterns under a select, where a pad reads one under a guard."""
    return len(te_rewrite.loads(op.body[0])) > 1 and _is_concat(op)


@functools.lru_cache(maxsize=1 << 16)
def classify(op: te.ComputeOp) -> tuple[str, str, bool]:
    """(kind, detail, compute_intensive) from the body and index expressions alone."""
    body = op.body[0]
    if isinstance(body, tirx.Reduce):
        # Compute-intensive: some operand element feeds several outputs through the summed
        # axis (GEMM, conv, batched GEMV), i.e. arithmetic intensity grows with the problem.
        products = []
        for src in body.source:
            tvm_ffi.structural_walk(src, (tirx.Mul, lambda m: products.append(
                bool(te_rewrite.loads(m.a)) and bool(te_rewrite.loads(m.b)))))
        heavy = any(products) and any(
            p == "reduce-read" and r > 1 and math.prod(_ints(t.shape)) > 1
            for t, i in te_rewrite.loads(body) for p, r in [access_pattern(op, t, i)])
        return REDUCTION, ("contraction" if heavy else "reduce"), heavy
    lds = te_rewrite.loads(body)
    patterns = [access_pattern(op, t, i)[0] for t, i in lds]
    if "gather" in patterns:
        return GATHER, "gather", False
    if selects_among_loads(op) and tir_stats.expr_flops(body) == 0:      # of several tensors, or one's pieces
        return ONE_TO_ONE, "concat", False
    if tir_stats.expr_flops(body) > 0:
        return ONE_TO_ONE, "elementwise", False
    for p, name in (("permute", "transpose"), ("remap", "reshape"), ("slice", "slice"), ("broadcast", "broadcast")):
        if p in patterns:
            return ONE_TO_ONE, name, False
    if _is_concat(op):
        return ONE_TO_ONE, "pad", False
    return ONE_TO_ONE, "copy" if patterns else "constant", False


def stage_names(stages: list[te.Tensor]) -> dict:
    """Unique, stable display names (``matmul``, ``matmul#1``, ...) in topological order."""
    seen: Counter = Counter()
    names = {}
    for t in stages:
        if t.op in names:
            continue
        seen[t.op.name] += 1
        names[t.op] = t.op.name if seen[t.op.name] == 1 else f"{t.op.name}#{seen[t.op.name] - 1}"
    return names


def analyze(prog: TEProgram) -> Analysis:
    """Analyse every stage and edge of ``prog``."""
    stages = prog.stages()
    consumers = Counter()
    for t in stages:
        for inp in {x.op for x in t.op.input_tensors}:
            consumers[inp] += 1
    for o in prog.opaque:
        for t in o.inputs.values():
            consumers[t.op] += 1
    for t in prog.outputs:
        consumers[t.op] += 1
    infos = []
    names = stage_names(stages)
    for t in stages:
        op = t.op
        name = names[op]
        kind, detail, heavy = classify(op)
        edges, footprint = [], 0
        seen_producers = set()
        for prod, idx in te_rewrite.loads(op.body[t.value_index]):
            pattern, reuse = access_pattern(op, prod, idx)
            edges.append(Edge(prod.op.name, index_map_text(op, idx), pattern, round(reuse, 3)))
            if prod.op not in seen_producers:
                seen_producers.add(prod.op)
                footprint += tensor_bytes(prod)
        infos.append(StageInfo(name, prog.op_of.get(op, "?"), kind, detail, heavy, _ints(t.shape), str(t.dtype),
                               stage_flops(op), footprint + tensor_bytes(t), consumers[op], edges))
    for o in prog.opaque:
        for out in o.outputs:
            infos.append(StageInfo(o.name, getattr(o.call.op, "name", "?"), OPAQUE, "opaque", False,
                                   _ints(out.shape), str(out.dtype), 0, tensor_bytes(out), consumers[out.op],
                                   [], o.reason))
    return Analysis(infos)


def narrowed_reduction(op) -> str | None:
    """The name of the reduction whose float result ``op`` only casts to a narrower float type
    (a float32-accumulated fp16/bf16 GEMM's cast back), else None: such a cast is the reduction's
    epilogue, so the narrow tensor is the one written."""
    if not isinstance(op, te.ComputeOp):
        return None
    body = op.body[0]
    if not isinstance(body, tirx.Cast) or not te_rewrite.is_load(body.value):
        return None
    (src, _), = te_rewrite.loads(body)
    wide, narrow = str(src.dtype), str(op.output(0).dtype)
    floats = ("float", "bfloat")
    if not (wide.startswith(floats) and narrow.startswith(floats)) or \
            tir_stats.dtype_bytes(narrow) >= tir_stats.dtype_bytes(wide):
        return None
    return src.op.name if isinstance(src.op, te.ComputeOp) and classify(src.op)[0] == REDUCTION else None
