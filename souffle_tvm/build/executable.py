"""Build a Relax module with TVM's own default pipeline (``--fusion tvm``, and Souffle's module
of already scheduled group PrimFuncs), with its kernels inventoried.

The default pipeline is run in two halves so the kernel structure can be read in between:
(1) library dispatch + legalization (LegalizeOps, FuseOps, FuseTIR, dlight on CUDA): the
fused module, whose ``main`` calls each PrimFunc; (2) dataflow lowering + finalization,
given to ``tvm.compile`` as its Relax pipeline; in between, every PrimFunc is put under a root
block (``core.root_block``: stitched kernels come in launch form, which Relax's passes reject).
The TIR pipeline is TVM's default s_tir pipeline (the stitched kernels without a second
``CompactBufferAllocation``: ``compacted_once``) between our passes: first shared memory over
the 48 KB static limit made dynamic (``dynamic_shared``), the stitched kernels' register caps
(``launch_bounds``) and
distinct parameter names (so each device kernel's buffers trace back to their parameter
positions), then the cooperative-launch tag and one read-only pass that records every device
kernel.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.s_tir.pipeline import default_s_tir_pipeline

from . import index_guard
from .compacted_once import compacted_once
from .cooperative import attach_cooperative_launch
from .dynamic_shared import dynamic_shared_over_limit
from .launch_bounds import apply_register_caps
from .param_names import distinct_param_names
from .typed_views import typed_shared_views
from ..codegen.database import register_tensor_intrinsics
from ..codegen.rules import NothingToWrite
from ..codegen.schedule import host_loops
from ..cost import tir_counts, tir_stats

from ..core.root_block import ensure_root_blocks
from ..core.targets import is_cuda
from ..cost.work import BlockCounts


@dataclass
class DeviceKernel:
    """One ``__global__`` function as TVM lowered it."""

    name: str
    primfunc: str
    grid: list[int]
    block: list[int]
    global_buffers: dict                 # parameter position of ``primfunc`` (name for scratch) -> bytes
    stored: set                          # the keys of ``global_buffers`` it stores to
    dyn_shared_bytes: int = 0
    cooperative: bool = False
    tensor_core: bool = False
    elem_bytes: int = 4                  # element size of what it stores
    counts: BlockCounts | None = None    # what one block executes, for the static floors


@dataclass
class BuildResult:
    executable: relax.Executable
    fused: tvm.IRModule
    kernels: list[DeviceKernel]
    calls: dict[str, int]                 # PrimFunc name -> calls per inference from main
    flops: dict[str, dict[str, int]]      # PrimFunc name -> {written buffer: flops}
    footprints: dict[str, dict]           # PrimFunc name -> {parameter position: bytes touched}
    seconds: float
    stage_seconds: dict[str, float] = field(default_factory=dict)


# -- recording TIR pipeline ---------------------------------------------------------------------
@dataclass
class _Record:
    kernels: list[DeviceKernel] = field(default_factory=list)
    positions: dict[str, dict[str, int]] = field(default_factory=dict)   # PrimFunc -> {param name: position}


_recording: list[_Record] = []


def _dyn_shared_bytes(func: tirx.PrimFunc) -> int:
    total = 0

    def alloc(node):
        nonlocal total
        if str(node.buffer.ty.storage_scope) == "shared.dyn":
            total += tir_stats.buffer_bytes(node.buffer)

    tvm_ffi.structural_walk(func.body, (tirx.AllocBuffer, alloc))
    return total


@tvm.transform.module_pass(opt_level=0, name="souffle_tvm.RememberParamPositions")
def remember_param_positions(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """Read-only, after ``distinct_param_names``: each PrimFunc's {parameter name: position},
    for ``record_device_kernels``."""
    if _recording:
        for gv, f in mod.functions.items():
            if isinstance(f, tirx.PrimFunc):
                _recording[-1].positions[gv.name_hint] = {str(p.name): i for i, p in enumerate(f.params)}
    return mod


@tvm.transform.module_pass(opt_level=0, name="souffle_tvm.RecordDeviceKernels")
def record_device_kernels(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """Read-only: remember each device kernel's launch shape and global buffers (keyed by the
    launching PrimFunc's parameter positions)."""
    if not _recording:
        return mod
    # Which PrimFunc launches each kernel: its host side calls the kernel by name.
    launcher: dict[str, str] = {}

    def launch(call, host: str) -> None:
        if getattr(call.op, "name", "") == "tirx.call_ffi_kernel":
            launcher.setdefault(str(call.args[0].value), host)

    for gv, func in mod.functions.items():
        if isinstance(func, tirx.PrimFunc):
            tvm_ffi.structural_walk(func.body, (tvm.ir.Call, lambda c, host=gv.name_hint: launch(c, host)))
    for gv, func in mod.functions.items():
        if not isinstance(func, tirx.PrimFunc) or func.attrs is None:
            continue
        if "tirx.kernel_launch_params" not in func.attrs:
            continue
        grid, block = tir_stats.launch_extents(func)
        name = gv.name_hint
        primfunc = launcher.get(name, name)
        buffers, stored = tir_stats.kernel_global_buffers(func, _recording[-1].positions.get(primfunc, {}))
        _recording[-1].kernels.append(DeviceKernel(
            name, primfunc, grid, block, buffers, stored, _dyn_shared_bytes(func),
            "tirx.use_cooperative_launch" in list(func.attrs["tirx.kernel_launch_params"]),
            tir_stats.uses_tensor_cores(func), tir_stats.stored_element_bytes(func), tir_counts.block_counts(func)))
    return mod


def _recording_pipeline():
    pipeline, host, device = default_s_tir_pipeline()
    # Kernels without a grid sync are left untouched by attach_cooperative_launch.
    # (shared memory over the static limit made dynamic first: the launch form it measures has no caps yet)
    return tvm.transform.Sequential([dynamic_shared_over_limit, apply_register_caps, distinct_param_names,
                                     remember_param_positions, compacted_once(pipeline), typed_shared_views,
                                     attach_cooperative_launch, record_device_kernels]), host, device


def device_counts(func: tirx.PrimFunc, target: tvm.target.Target) -> list[BlockCounts]:
    """What one block of each device kernel of a scheduled PrimFunc executes when it is built as
    a kernel of its own (``cost.tir_counts``), in launch order: TVM's s_tir pipeline decides
    where barriers go (a K loop ThreadSync guards with a barrier a step is priced by its waits),
    which the stitcher's launch form does not show yet."""
    host = target if target.host is not None else tvm.target.Target(target, host="llvm")   # SplitHostDevice needs one
    mod = tirx.transform.BindTarget(host)(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}))
    pipeline, _, _ = default_s_tir_pipeline()
    with target:
        mod = pipeline(mod)
    kernels = [(gv.name_hint, f) for gv, f in mod.functions.items() if isinstance(f, tirx.PrimFunc)
               and f.attrs is not None and "tirx.kernel_launch_params" in f.attrs]

    def order(name: str) -> int:
        tail = name.rsplit("_", 1)[-1]
        return int(tail) if tail.isdigit() else 0
    return [tir_counts.block_counts(f) for _, f in sorted(kernels, key=lambda k: order(k[0]))]


# shared memory over 48 KB made dynamic + register caps + distinct parameter names + TVM's s_tir pipeline
# + cooperative tag + kernel record
TIR_PIPELINE = "souffle_tvm.recorded"
tirx.register_tir_pipeline(TIR_PIPELINE, _recording_pipeline)


@contextlib.contextmanager
def recording():
    """The device kernels the recording TIR pipeline sees inside the ``with`` (a list it fills)."""
    _recording.append(_Record())
    try:
        yield _recording[-1].kernels
    finally:
        _recording.pop()


# -- the pipeline halves ------------------------------------------------------------------------
def _backend(target: tvm.target.Target):
    if is_cuda(target):
        from tvm.relax.backend.cuda import pipeline
    else:
        from tvm.relax.backend.cpu_generic import pipeline
    return pipeline


def _passed_over_if_raising(rule):
    """A dlight rule that, where it raises or launches its kernel from a host loop, does not apply
    (the next rule is tried), as our own rules are treated in ``codegen.schedule``. dlight's Matmul
    raises "There are some consumers of the cache-write stage that are not properly inlined" on
    one of EfficientNet's fused functions (torch exports, ``--fusion tvm`` on CUDA), which ended
    the whole build; its GeneralReduction launches a reduction to a 0-d result once per term.

    Before an fp16 function, the CUDA tensor intrinsics dlight's Matmul imports are registered
    our way (``register_tensor_intrinsics``: 3 s instead of dlight's import of every target's)."""
    from tvm.s_tir import dlight as dl

    def apply(func, target, tunable):
        if is_cuda(target) and any(str(getattr(p.ty, "dtype", "")) == "float16" for p in func.params):
            register_tensor_intrinsics(target)
        try:
            sch = rule.apply(func, target, tunable)
        except Exception:  # noqa: BLE001 - dlight raises AssertionError/ScheduleError/...; Fallback follows
            return None
        # a kernel launched per iteration of a host loop (GeneralReduction on a 0-d result): Fallback follows
        one = sch[0] if isinstance(sch, list) and sch else sch
        return None if one is not None and host_loops(one.mod["main"]) else sch

    return dl.ScheduleRule.from_callable(type(rule).__name__)(apply)


def _legalize_passes(p, target: tvm.target.Target) -> list:
    from tvm.s_tir import dlight as dl

    passes = list(p.legalize_passes(target))
    if is_cuda(target) and passes and isinstance(passes[-1], tvm.transform.Pass) and "ApplyDefaultSchedule" in str(
            passes[-1].info.name):
        # TVM 0.27's own rule list (relax/backend/cuda/pipeline.py), each passed over where it raises,
        # after a function that writes only empty tensors is given its empty schedule
        rules = [dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction()]
        passes[-1] = dl.ApplyDefaultSchedule(NothingToWrite(), *[_passed_over_if_raising(r) for r in rules],
                                             dl.gpu.Fallback())
    return passes


def fuse(mod: tvm.IRModule, target: tvm.target.Target) -> tvm.IRModule:
    """First half of TVM's default pipeline: dispatch, legalize, FuseOps/FuseTIR (and dlight on CUDA)."""
    p = _backend(target)
    with target:
        return tvm.transform.Sequential(p.library_dispatch_passes(target) + _legalize_passes(p, target))(mod)


def lower_passes(target: tvm.target.Target) -> tvm.transform.Pass:
    """Second half: dataflow lowering and VM finalization."""
    p = _backend(target)
    return tvm.transform.Sequential(p.dataflow_lower_passes(target) + p.finalize_passes(target))


def primfunc_calls(mod: tvm.IRModule) -> dict[str, int]:
    """Calls per inference of each PrimFunc from ``main`` (TVM's fused form: one call_tir each).

    A reshape PrimFunc launches nothing: the lowering half's RewriteDataflowReshape turns its
    call into a zero-copy view, so it is applied before counting (a GPU trace confirmed it).
    """
    mod = relax.transform.RewriteDataflowReshape()(mod)
    prim = {gv.name_hint for gv, f in mod.functions.items() if isinstance(f, tirx.PrimFunc)}
    calls: dict[str, int] = {}

    def visit(node):
        if isinstance(node, relax.Call):
            for arg in [node.op, *node.args]:
                if isinstance(arg, tvm.ir.GlobalVar) and arg.name_hint in prim:
                    calls[arg.name_hint] = calls.get(arg.name_hint, 0) + 1

    relax.analysis.post_order_visit(mod["main"], visit)
    return calls


def unscheduled_stats(mod: tvm.IRModule, target: tvm.target.Target):
    """Per PrimFunc: useful flops and buffer footprints, read before any GPU schedule
    (so tile padding is not counted)."""
    # The CPU backend's legalization is the CUDA one without dlight's schedules: the same
    # fused PrimFuncs (same names), unscheduled.
    from tvm.relax.backend.cpu_generic import pipeline as unscheduled

    with target:
        unsched = tvm.transform.Sequential(unscheduled.library_dispatch_passes(target)
                                           + unscheduled.legalize_passes(target))(mod)
    funcs = {gv.name_hint: f for gv, f in unsched.functions.items() if isinstance(f, tirx.PrimFunc)}
    return ({n: tir_stats.block_flops(f) for n, f in funcs.items()},
            {n: tir_stats.block_footprints(f) for n, f in funcs.items()})


def build(mod: tvm.IRModule, target: tvm.target.Target, stats_from: tvm.IRModule | None = None) -> BuildResult:
    """Build ``mod`` with TVM's default pipeline and return the executable and its kernel inventory.

    Flops and footprints are read from ``stats_from`` (default ``mod``) before any schedule; pass
    the unscheduled twin of a module whose PrimFuncs arrive already scheduled.
    """
    t0 = time.perf_counter()
    # stitched kernels come in launch form: under a root block, as TVM's Relax passes require
    fused = ensure_root_blocks(fuse(mod, target))
    t1 = time.perf_counter()
    with recording() as kernels, index_guard.watching() as hazards:
        ex = tvm.compile(fused, target, relax_pipeline=lower_passes(target), tir_pipeline=TIR_PIPELINE)
    index_guard.check(hazards)
    t2 = time.perf_counter()
    calls = primfunc_calls(fused)
    flops, footprints = unscheduled_stats(stats_from if stats_from is not None else mod, target)
    return BuildResult(ex, fused, list(kernels), calls, flops, footprints, t2 - t0,
                       {"fuse": t1 - t0, "codegen": t2 - t1, "inventory": time.perf_counter() - t2})
