"""Buffer indices that TVM 0.27 changes in value as it flattens them, caught before they run.

``FlattenBuffer`` simplifies every index with ``IterMapSimplify`` over the enclosing loops and
thread extents. In TVM 0.27 that drops the remainder of the constant of a floordiv or floormod
whose dividend holds an iterator with a negative scale: ``(127 - b) // 8`` becomes
``b // -8 + 15`` (wrong unless 8 divides b) and ``(127 - b) % 8`` becomes ``b % -8 * -1``.
A kernel with such an index silently reads or writes the wrong element. The emulator's reversed
block order made one (``runtime.emulate`` reads a table now); no kernel of the zoo has one
(tests/test_index_guard.py). ``watching`` looks at every PrimFunc right before FlattenBuffer
while a build runs, and ``check`` raises ``MiscompileError`` naming the kernel and the index
instead of letting a wrong answer through (docs/tvm-workarounds.md).
"""

from __future__ import annotations

import contextlib
import random
import zlib
from dataclasses import dataclass

import tvm
import tvm_ffi
from tvm import tirx

from ..errors import MiscompileError
from ..te.rewrite import dtype_of

_SAMPLES = 16          # points of the loop domains, besides its two corners, each suspect is evaluated at


@dataclass(frozen=True)
class Hazard:
    """One buffer index that TVM's flattening would give another value."""

    kernel: str
    buffer: str
    index: str        # as written
    becomes: str      # as IterMapSimplify rewrites it
    at: dict          # a loop point where the two differ: {variable name: value}

    def __str__(self) -> str:
        point = ", ".join(f"{k}={v}" for k, v in self.at.items())
        return f"{self.kernel}: {self.buffer}[{self.index}] would become [{self.becomes}] (differs at {point})"


def _negative_term(e: tvm.ir.Expr) -> bool:
    """Whether ``e`` may hold a variable with a negative coefficient (over-approximated)."""
    found = []

    def sub(x):
        if not isinstance(x.b, tirx.IntImm):
            found.append(x)

    def mul(x):
        if any(isinstance(o, tirx.IntImm) and int(o) < 0 for o in (x.a, x.b)):
            found.append(x)
    tvm_ffi.structural_walk(e, [(tirx.Sub, sub), (tirx.Mul, mul)])
    return bool(found)


def _suspect(index: tvm.ir.Expr) -> bool:
    """A floordiv or floormod by a constant whose dividend may have a negative-scale term."""
    found = []

    def visit(x):
        if isinstance(x.b, tirx.IntImm) and _negative_term(x.a):
            found.append(x)
    tvm_ffi.structural_walk(index, [(tirx.FloorDiv, visit), (tirx.FloorMod, visit)])
    return bool(found)


def _value(e: tvm.ir.Expr, point: dict) -> int | None:
    out = tvm.sym.Analyzer().simplify(tvm_ffi.structural_map(e, (tirx.Var, lambda v: point.get(v, v))))
    return int(out) if isinstance(out, tirx.IntImm) else None


def _points(dom: dict, seed: int) -> list[dict]:
    """The domain's lowest and highest corners and seeded random points; none where it is symbolic."""
    bounds = []
    for v, r in dom.items():
        if not isinstance(r.min, tirx.IntImm) or not isinstance(r.extent, tirx.IntImm) or int(r.extent) < 1:
            return []
        bounds.append((v, int(r.min), int(r.min) + int(r.extent) - 1))
    rng = random.Random(seed)
    picks = [[lo for _, lo, _ in bounds], [hi for _, _, hi in bounds]]
    picks += [[rng.randint(lo, hi) for _, lo, hi in bounds] for _ in range(_SAMPLES)]
    return [{v: tirx.const(x, dtype_of(v)) for (v, _, _), x in zip(bounds, pick)} for pick in picks]


def _differs(index, becomes, dom: dict) -> dict | None:
    for point in _points(dom, zlib.crc32(str(index).encode())):
        a, b = _value(index, point), _value(becomes, point)
        if a is not None and b is not None and a != b:
            return {v.name: int(x) for v, x in point.items()}
    return None


def hazards(func: tirx.PrimFunc, name: str = "kernel") -> list[Hazard]:
    """The accesses of a lowered PrimFunc (loops and thread extents, as FlattenBuffer sees it)
    whose index ``IterMapSimplify`` over their loop domains changes in value."""
    found: list[Hazard] = []

    def accesses(stmt) -> list:
        out = [(stmt.buffer, list(stmt.indices))] if isinstance(stmt, tirx.BufferStore) else []
        for field in ("value", "condition"):
            value = getattr(stmt, field, None)
            if isinstance(value, tvm.ir.Expr) and tvm.ir.is_prim_expr(value):
                tvm_ffi.structural_walk(value, (tvm.ir.TensorLoad, lambda x: out.append((x.source, list(x.indices)))))
        return out

    def check(stmt, dom: dict) -> None:
        for buf, indices in accesses(stmt):
            if not any(_suspect(i) for i in indices):
                continue
            try:
                simplified = tvm.sym.iter_map_simplify(indices, dom)
            except Exception:  # noqa: BLE001 - an index IterMap cannot read is left as it is by TVM too
                continue
            for index, becomes in zip(indices, simplified):
                at = _differs(index, becomes, dom)
                if at is not None:
                    found.append(Hazard(name, buf.name, str(index), str(becomes), at))

    def walk(stmt, dom: dict) -> None:
        if isinstance(stmt, tirx.For):
            walk(stmt.body, dom | {stmt.loop_var: tvm.ir.Range.from_min_extent(stmt.min, stmt.extent)})
            return
        if isinstance(stmt, tirx.AttrStmt) and stmt.attr_key in ("thread_extent", "virtual_thread"):
            var = stmt.node.var
            walk(stmt.body, dom | {var: tvm.ir.Range.from_min_extent(tirx.const(0, dtype_of(var)), stmt.value)})
            return
        if isinstance(stmt, tirx.SeqStmt):
            for s in stmt.seq:
                walk(s, dom)
            return
        check(stmt, dom)
        for field in ("body", "then_case", "else_case"):
            child = getattr(stmt, field, None)
            if isinstance(child, tirx.Stmt):
                walk(child, dom)

    walk(func.body, {})
    return found


class _Watch:
    """A pass instrument: every PrimFunc's hazards, read right before FlattenBuffer."""

    def __init__(self):
        self.found: list[Hazard] = []

    def run_before_pass(self, mod, info) -> None:
        if info.name != "tirx.FlattenBuffer":
            return
        for gv, func in mod.functions.items():
            if isinstance(func, tirx.PrimFunc):
                self.found.extend(hazards(func, gv.name_hint))


@contextlib.contextmanager
def watching():
    """Builds inside the ``with`` have their indices watched (the current context's opt level,
    config and instruments kept); yields the list of ``Hazard`` it fills."""
    current = tvm.transform.PassContext.current()
    watch = tvm.ir.instrument.pass_instrument(_Watch)()
    with tvm.transform.PassContext(opt_level=current.opt_level, config=dict(current.config),
                                   required_pass=list(current.required_pass),
                                   disabled_pass=list(current.disabled_pass),
                                   instruments=[*current.instruments, watch]):
        yield watch.found


def check(found: list[Hazard]) -> None:
    """Raise ``MiscompileError`` if a watched build had a hazard."""
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise MiscompileError(f"TVM 0.27 would miscompile an index (IterMapSimplify in FlattenBuffer drops the "
                              f"remainder of a negative-scale dividend's constant): {found[0]}{more}")
