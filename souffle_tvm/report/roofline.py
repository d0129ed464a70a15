"""A roofline *estimate* of a compiled model's GPU latency, from its report and the hardware table.

Per kernel launch: ``max(bytes / DRAM bandwidth, flops / peak)`` plus the launch overhead, plus
the grid-sync overhead per grid sync. ``floor`` is the same bound for the whole model as one
ideal kernel (one launch, no syncs, its compulsory traffic only: what the model reads from
outside and writes as outputs). These are estimates from datasheet peaks, never measurements:
bytes are the TIR's access footprints (caches ignored), flops count multiply-adds as two.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..cost.hardware import GPU
from .schema import Report


@dataclass(frozen=True)
class Roofline:
    seconds: float          # the estimate for the compiled kernels
    floor: float            # the whole model as one ideal kernel
    memory_seconds: float   # of ``seconds``: kernels bound by bandwidth
    compute_seconds: float  # ... by arithmetic
    overhead_seconds: float  # ... launches and grid syncs


def peak_flops(gpu: GPU, dtype: str) -> float:
    return gpu.fp16_flops if dtype in ("float16", "bfloat16") else gpu.fp32_flops


def estimate(report: Report, gpu: GPU, dtype: str = "float32", compulsory_bytes: int | None = None) -> Roofline:
    """The roofline estimate of ``report``'s kernels on ``gpu``; ``compulsory_bytes`` (inputs,
    weights and outputs) gives the floor its memory term."""
    peak = peak_flops(gpu, dtype)
    mem = comp = over = 0.0
    for k in report.kernels:
        t_mem, t_comp = k.bytes / gpu.dram_bandwidth, k.flops / peak
        if t_mem >= t_comp:
            mem += k.launches * t_mem
        else:
            comp += k.launches * t_comp
        over += k.launches * (gpu.launch_overhead_s + (k.grid_syncs or 0) * gpu.grid_sync_overhead_s)
    floor = max((compulsory_bytes or 0) / gpu.dram_bandwidth, report.flops / peak) + gpu.launch_overhead_s
    return Roofline(mem + comp + over, floor, mem, comp, over)


def compulsory_bytes(model) -> int:
    """What any implementation must move: the model's inputs, weights and outputs (an
    ``ImportedModel``; output shapes from its ONNX graph)."""
    import numpy as np
    from onnx import helper

    total = sum(int(np.prod(t.shape)) * np.dtype(t.dtype).itemsize for t in model.inputs)
    total += sum(int(p.nbytes) for p in model.params)
    for out in model.onnx_model.graph.output:
        tt = out.type.tensor_type
        dims = [d.dim_value for d in tt.shape.dim]
        if dims and all(d > 0 for d in dims):
            total += int(np.prod(dims)) * np.dtype(helper.tensor_dtype_to_np_dtype(tt.elem_type)).itemsize
    return total
