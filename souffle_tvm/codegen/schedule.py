"""Per-group schedules: schedule rules on CUDA; the plain loop nest on llvm (the CPU twin).

``schedule_group`` is a small driver in the manner of dlight's ``ApplyDefaultSchedule``: it
tries ``default_rules`` in order and the first rule whose ``apply`` returns a Schedule wins.
The rules are dlight's (Matmul, GEMV, Reduction, GeneralReduction, Fallback) and, for the
stages of a stitched kernel, ours (``codegen/rules/``). A rule that raises on a fused group is
passed over like one that does not match, and ``Scheduled.notes`` says which rule raised and
why, so the result says *which* rule scheduled the group. The partitioner compares that with
the rule its anchor gets alone: fusing must not degrade a tiled GEMM to the fallback schedule.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.s_tir import dlight as dl

from ..core.geometry import MATMUL_K_TILE, MATMUL_THREADS, STITCH_BLOCK, STITCH_BLOCKS
from ..core.ir_names import GEMM_K_TILE_ATTR
from ..core.targets import is_cuda
from ..errors import ScheduleError
from .rules import (AlignedTiles, AtomicRows, ColumnReduction, NothingToWrite, PartialRows, RowChain, RowReduction,
                    SerialReduction, StitchedMatmul, TensorCoreMatmul, TiledCombine, WindowChain)


class RuleNote(str):
    """Why a rule was passed over, as "Rule: why" text (what reasons and reports print), with the
    rule's ``rule_name`` as data (``.rule``) for whoever compares rules."""

    rule: str

    def __new__(cls, rule: str, text: str) -> "RuleNote":
        note = super().__new__(cls, text)
        note.rule = rule
        return note


@dataclass
class Scheduled:
    func: tirx.PrimFunc
    rule: str          # the rule that applied (``rule_name``; "none" on llvm)
    # "Rule: why" for each rule passed over before ``rule`` applied: it raised, or its schedule
    # was refused (``undefined_buffers``)
    notes: list[RuleNote] = field(default_factory=list)
    failures: int = 0  # how many of those rules raised an exception


# How much of the hardware a rule's schedule uses; fusing must not lower it. SerialReduction
# is Fallback's form (one output per thread) chosen on purpose: a GEMM anchor that gets it
# alone does not make a fused group that gets Fallback's the same form a degradation.
RANK = {"NothingToWrite": 3, "AlignedTiles": 0, "database": 3, "RowChain": 3, "WindowChain": 3, "Matmul": 3, "TensorCoreMatmul": 3, "PartialRows": 2,
        "AtomicRows": 2, "TiledCombine": 2, "GEMV": 2, "Reduction": 2,
        "ColumnReduction": 2, "SerialReduction": 0, "GeneralReduction": 2, "Fallback": 0, "none": 0}


def default_rules(block_size: int | None, gemm_k_tile: int | None = None,
                  gemm_tile: int | None = None) -> list[dl.ScheduleRule]:
    """The rules ``schedule_group`` tries, in order."""
    if block_size is None:
        return [NothingToWrite(), RowChain(), dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(),
                dl.gpu.GeneralReduction(), dl.gpu.Fallback()]
    # One block size for every stage of a stitched kernel: rules whose thread count is fixed
    # by the rule itself (GEMV, Reduction) are left out.
    if block_size not in STITCH_BLOCKS:
        raise ScheduleError(f"stitched stages are scheduled with {' or '.join(map(str, STITCH_BLOCKS))} threads "
                            f"(asked: {block_size})")
    gemms = [TensorCoreMatmul(warps=block_size // 32),
             StitchedMatmul(gemm_k_tile, gemm_tile and gemm_tile // MATMUL_THREADS, threads=block_size)]
    rest = [ColumnReduction(block_size), SerialReduction(block_size), RowReduction(block_size), dl.gpu.Fallback()]
    # The two-phase partials are cut to their GEMM's tile at STITCH_BLOCK threads
    # (``STITCH_BLOCK_ONLY_RULES``).
    return ([NothingToWrite(), AlignedTiles(block_size), RowChain(block_size), WindowChain(block_size)] + ([AtomicRows(), PartialRows(), TiledCombine(block_size)]
                                      if block_size == STITCH_BLOCK else []) + gemms + rest)


# Rules that schedule stitched stages at ``STITCH_BLOCK`` threads only: a subprogram with a stage
# one of them scheduled keeps that block size (``partition.block_choice``).
STITCH_BLOCK_ONLY_RULES = frozenset({"AtomicRows", "PartialRows", "TiledCombine", "database"})


def rule_name(rule: dl.ScheduleRule) -> str:
    """The name ``Scheduled.rule`` and ``RANK`` use: the class name, or the dlight rule's a rule of
    ours sizes to the stitched block (``REPORTED_AS``)."""
    return REPORTED_AS.get(type(rule).__name__, type(rule).__name__)


# our rules that are dlight's at another block size, by the name of dlight's
REPORTED_AS = {"StitchedMatmul": "Matmul", "RowReduction": "GeneralReduction"}


def form_of(rule: str, block_size: int | None, func: tirx.PrimFunc | None = None) -> str:
    """A schedule's form, what the latency model's measurements are kept by: the rule's own
    class and the block size (``dlight <rule>`` where dlight's rules chose their own), and a
    SIMT GEMM's K tile where the scheduled ``func`` has another than dlight's ("/k64")."""
    if block_size is None:
        return f"dlight {rule}"
    own = {v: k for k, v in REPORTED_AS.items()}.get(rule, rule)
    attrs = func.attrs if func is not None and func.attrs is not None else {}
    k_tile = int(attrs[GEMM_K_TILE_ATTR]) if GEMM_K_TILE_ATTR in attrs else MATMUL_K_TILE
    return f"{own}@{block_size}" + (f"/k{k_tile}" if k_tile != MATMUL_K_TILE else "")


def epilogue_in_init(func: tirx.PrimFunc) -> list[str]:
    """Names of the reduction blocks whose init reads a buffer: an epilogue inlined into the
    reduction, which then applies it twice (once in the init, once per update).

    A correct schedule has none (an init writes the reducer's identity). TVM 0.27's
    ``reverse_compute_inline`` does this to a reduction whose reduce axis has extent 1 (a GEMM
    with K = 1: dlight's rules inline ``+ bias`` into both; docs/tvm-workarounds.md)."""
    bad: list[str] = []

    def block(b):
        if b.init is None:
            return
        loads: list = []
        tvm_ffi.structural_walk(b.init, (tvm.ir.TensorLoad, lambda ld: loads.append(ld)))
        if loads:
            bad.append(str(b.name_hint))

    tvm_ffi.structural_walk(func.body, (s_tir.SBlock, block))
    return bad


def host_loops(func: tirx.PrimFunc) -> list[str]:
    """The serial loops (extent over 1) a scheduled ``func`` runs outside every thread binding and
    around one: on the GPU each iteration is a kernel launch from the host. dlight's
    ``GeneralReduction`` schedules a reduction to a 0-d result that way: a global mean of 64 x 1024
    became 65,536 one-thread launches adding one term each (docs/tvm-workarounds.md). A K loop
    inside the launch that re-binds threads to copy a tile is not one."""
    def bound(loop) -> bool:
        return loop.kind == tirx.ForKind.THREAD_BINDING

    inside = set()          # loops under a thread binding: device code
    for loop in _loops(func.body):
        if bound(loop):
            inside.update(map(_key, _loops(loop.body)))
    return [str(loop.loop_var.name) for loop in _loops(func.body)
            if not bound(loop) and _key(loop) not in inside and isinstance(loop.extent, tirx.IntImm)
            and int(loop.extent) > 1 and any(bound(x) for x in _loops(loop.body))]


def _loops(node) -> list:
    found = []
    tvm_ffi.structural_walk(node, (tirx.For, found.append))
    return found


def _key(loop) -> int:
    return loop.loop_var.__hash__()


def undefined_buffers(func: tirx.PrimFunc) -> list[str]:
    """Names of the buffers ``func`` loads or stores that nothing defines: no parameter, block
    allocation, match_buffer, AllocBuffer or DeclBuffer.

    A correct schedule has none. TVM 0.27's ``reverse_compute_inline`` leaves one behind when
    the producer's buffer has a second consumer (reproducer and where dlight's Matmul meets
    it: docs/tvm-workarounds.md, "reverse_compute_inline drops a buffer").
    """
    import tvm_ffi

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
                   gemm_k_tile: int | None = None, gemm_tile: int | None = None) -> Scheduled:
    """Schedule ``func`` for ``target`` with the first rule that applies.

    ``block_size`` forces every rule to use that many threads per block (stitched kernels);
    ``gemm_k_tile`` sets the stitched GEMMs' K tile (shared tiles over 48 KB become dynamic),
    ``gemm_tile`` their output tile side (16, 32 or 64; None: sized to the stitched grid).
    Raises ``ScheduleError`` when no rule applies.
    """
    if not is_cuda(target):
        return Scheduled(func, "none")
    if block_size is not None:
        attrs = dict(target.attrs)
        attrs.update({"kind": "cuda", "max_num_threads": block_size, "max_threads_per_block": block_size})
        attrs.pop("keys", None)
        target = tvm.target.Target(attrs)
    notes: list[RuleNote] = []
    failures = 0
    with target:
        for rule in default_rules(block_size, gemm_k_tile, gemm_tile):
            if not rule.is_target_available(target):
                continue
            try:
                sch = rule.apply(func, target, False)
            except Exception as err:  # noqa: BLE001 - dlight's rules assert on forms they do not handle
                lines = str(err).strip().splitlines()
                notes.append(RuleNote(rule_name(rule), f"{type(rule).__name__}: {type(err).__name__} "
                                                       f"{(lines[-1] if lines else '')[:120]}"))
                failures += 1
                continue
            if sch is None:
                continue
            if isinstance(sch, list):
                sch = sch[0]
            out = sch.mod["main"].with_attr("tirx.is_scheduled", True)
            name = rule_name(rule)
            lost = undefined_buffers(out)
            if lost:
                # TVM 0.27 bug (docs/tvm-workarounds.md): a fixed TVM refuses the inlining and
                # dlight's rule then raises; do what that would do: the rule does not apply here.
                notes.append(RuleNote(name, f"{name}: its schedule reads {', '.join(lost)}, which TVM's "
                                            f"reverse_compute_inline removed (an epilogue with several outputs)"))
                continue
            around = host_loops(out) if rule_name(rule) != "Fallback" else []
            if around:
                notes.append(RuleNote(name, f"{name}: its schedule launches a kernel in each iteration of the "
                                            f"host loop(s) {', '.join(around)}"))
                continue
            twice = epilogue_in_init(out)
            if twice:
                # TVM 0.27 bug (docs/tvm-workarounds.md): the epilogue would be applied twice
                notes.append(RuleNote(name, f"{name}: its schedule inlines an epilogue into the init of "
                                            f"{', '.join(twice)} (a reduction of extent 1), applying it twice"))
                continue
            return Scheduled(out, name, notes, failures)
    raise ScheduleError("no dlight rule schedules it: " + "; ".join(notes))
