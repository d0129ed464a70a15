"""What the race checker and the prefetch check share: a module whose PrimFuncs are emulated
with a probe built in, compiled for llvm once, and run through the VM (or, for a module of one
PrimFunc, called directly on its arguments); and the IR the probes build their records from.
"""

from __future__ import annotations

import math

import numpy as np
import tvm
import tvm_ffi
from tvm import tirx

from ..build import index_guard
from ..stitch.kernel_ir import decompose, op_name
from ..te.rewrite import cast_like, dtype_of
from .emulate import emulate_primfunc
from .runner import run_vm

I64 = "int64"


def i64(v) -> tirx.PrimExpr:
    return tirx.const(v, I64)


def as64(e) -> tirx.PrimExpr:
    return e if dtype_of(e) == I64 else tirx.Cast(I64, e)


def seq(stmts: list) -> tirx.Stmt:
    flat = [x for s in stmts for x in (s.seq if isinstance(s, tirx.SeqStmt) else [s])]
    return flat[0] if len(flat) == 1 else tirx.SeqStmt(flat) if flat else tirx.Evaluate(i64(0))


def numel(buf) -> int:
    return math.prod(int(e) for e in buf.ty.shape)


def on_flat_block(block: tirx.Var, blocks: dict, body: tirx.Stmt) -> tuple[tirx.Stmt, int]:
    """``body`` (one emulated block of a phase) with its block coordinates read off the flat block
    index ``block`` (x fastest; ``blocks``: tag -> (var, extent)), and how many blocks there are."""
    order = [blocks[t] for t in ("blockIdx.x", "blockIdx.y", "blockIdx.z") if t in blocks]
    coords = decompose(block, [(v, i64(e)) for v, e in order])
    body = tvm_ffi.structural_map(body, (tirx.Var, lambda v: cast_like(coords[v], v) if v in coords else v))
    return body, math.prod(e for _, e in order)


def guarded_loads(expr, wanted) -> list:
    """(load, guard) for each load in ``expr`` that ``wanted(load)`` accepts, under the condition
    it is evaluated on (the branches of a Select or if_then_else; None: always)."""
    found = []

    def visit(e, guard):
        def one(node):
            if isinstance(node, tirx.Select) or op_name(node).endswith(".if_then_else"):
                c, a, b = (node.condition, node.true_value, node.false_value) if isinstance(node, tirx.Select) \
                    else tuple(node.args)
                visit(c, guard)
                visit(a, c if guard is None else tirx.And(guard, c))
                visit(b, tirx.Not(c) if guard is None else tirx.And(guard, tirx.Not(c)))
                return tvm_ffi.WalkResult.SKIP
            if isinstance(node, tirx.Let):
                visit(node.value, guard)
                visit(tvm_ffi.structural_map(node.body, (tirx.Var, lambda v: node.value if v.same_as(node.var) else v)),
                      guard)
                return tvm_ffi.WalkResult.SKIP
            if isinstance(node, tvm.ir.TensorLoad) and wanted(node):
                found.append((node, guard))
            return None
        tvm_ffi.structural_walk(e, one, order="pre")

    visit(expr, None)
    return found


# TVM passes that only optimise, and are slow on the instrumented kernels (the analyser works
# through every check): CompactBufferAllocation alone took 13 of bert's 25 s. The emulated
# buffers are declared compact already. StmtSimplify still runs before FlattenBuffer (which needs it).
_SKIPPED = ("s_tir.CompactBufferAllocation", "s_tir.HoistIfThenElse", "s_tir.LoopPartition", "tirx.RemoveNoOp",
            "tirx.CommonSubexprElim")


@tvm.ir.instrument.pass_instrument
class _Skip:
    def __init__(self):
        self.flat = False

    def run_after_pass(self, mod, info):
        self.flat = self.flat or info.name == "tirx.FlattenBuffer"

    def should_run(self, mod, info) -> bool:
        return info.name not in _SKIPPED and not (self.flat and info.name.endswith("StmtSimplify"))


def _compile(mod: tvm.IRModule):
    """llvm at -O0 with the optimising TIR passes left out: the emulated kernels run for
    milliseconds, their compilation took seconds (bert: 30 s, now 4)."""
    with tvm.transform.PassContext(instruments=[_Skip()]), index_guard.watching() as hazards:
        built = tvm.compile(mod, target=tvm.target.Target({"kind": "llvm", "opt-level": 0}))
    index_guard.check(hazards)
    return built


class RunSession:
    """One run of an instrumented module: its kernels' callbacks (registered global functions)
    reach the run in progress as ``type(self).current``. Runs of one kind do not nest."""

    current = None
    kind = "instrumented"          # what the emulations check, for the error

    def __enter__(self):
        if type(self).current is not None:
            raise RuntimeError(f"{self.kind} emulations do not nest")
        type(self).current = self
        return self

    def __exit__(self, *exc):
        type(self).current = None


class InstrumentedModule:
    """``mod``'s PrimFuncs emulated, each with the probe ``make_probe(name)`` handed to
    ``emulate_primfunc`` as keyword ``hook``, compiled for llvm once."""

    def __init__(self, mod: tvm.IRModule, target: tvm.target.Target, make_probe, hook: str):
        self.probes: dict = {}
        out = {}
        for gv, f in mod.functions.items():
            if isinstance(f, tirx.PrimFunc):
                self.probes[gv.name_hint] = make_probe(gv.name_hint)
                out[gv] = emulate_primfunc(f, target, gv.name_hint, **{hook: self.probes[gv.name_hint]})
            else:
                out[gv] = f
        relax_funcs = [gv for gv, f in mod.functions.items() if not isinstance(f, tirx.PrimFunc)]
        self.lone = None if relax_funcs or len(self.probes) != 1 else next(iter(self.probes))
        self.executable = _compile(tvm.IRModule(out, attrs=mod.attrs))

    def call(self, inputs: list, params: list | None = None) -> list:
        """Outputs of ``main``, or every argument of a lone PrimFunc after the call."""
        if self.lone is None:
            return run_vm(self.executable, list(params or []), list(inputs))
        args = [tvm.runtime.tensor(np.asarray(a)) for a in inputs]
        self.executable[self.lone](*args)
        return [a.numpy() for a in args]
