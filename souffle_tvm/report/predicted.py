"""The latency model's prediction for a report's kernels (``Report.latency``): an estimate of
GPU time from ``cost/latency.py`` with its fitted constants, never a measurement."""

from __future__ import annotations

from dataclasses import asdict

from ..cost import latency
from ..cost.hardware import for_arch
from .schema import Report


def kernels_of(report: Report) -> list[latency.Kernel]:
    return latency.kernels_from_rows([asdict(k) for k in report.kernels])


def add_latency(report: Report, constants: latency.Constants = latency.FITTED) -> None:
    """Fill ``report.latency`` on CUDA: one inference launched kernel by kernel and under a CUDA
    graph, and the kernels' own time."""
    if report.target != "cuda" or not report.kernels:
        return
    gpu = for_arch(report.arch or "sm_90")
    kernels = kernels_of(report)
    plain = latency.predict(gpu, constants, kernels, graphs=False)
    graph = latency.predict(gpu, constants, kernels, graphs=True)
    for row, t in zip(report.kernels, plain.kernels):
        row.predicted_us, row.floor_us, row.floor_by = round(t.seconds * 1e6, 4), round(t.floor * 1e6, 4), t.floor_by
    untimed = sum(k.launches * t.seconds for k, t, row in zip(kernels, plain.kernels, report.kernels)
                  if row.measured_form is False)
    report.latency = {"ms": round(plain.seconds * 1e3, 4), "graph_ms": round(graph.seconds * 1e3, 4),
                      "gpu_ms": round(plain.gpu_seconds * 1e3, 4), "gpu": gpu.name,
                      "resources": "ptxas" if report.nvcc.get("available") else "none (occupancy from threads only)",
                      "constants": constants.as_dict(),
                      # of the kernels' time, the share in schedule forms no GPU has run: extrapolation
                      "untimed_share": round(untimed / plain.gpu_seconds, 3) if plain.gpu_seconds else 0.0}
    if report.cuda_graph is not None:
        rewrite = latency.predict(gpu, constants, kernels, graphs=False, replays=report.cuda_graph["replays"])
        report.latency["rewrite_ms"] = round(rewrite.seconds * 1e3, 4)
