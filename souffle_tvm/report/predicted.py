"""The latency model's prediction written into a report (``Report.latency``, each row's
``predicted_us`` and floor): an estimate of GPU time from ``cost/latency.py`` with its fitted
constants, never a measurement. ``kernels_of`` reads a finished report's kernels back for the
model (experiments that price a saved report again under other constants)."""

from __future__ import annotations

from dataclasses import asdict

from ..cost import latency
from ..cost.hardware import for_arch
from .schema import Report


def kernels_of(report: Report) -> list[latency.Kernel]:
    """A report's kernels as the latency model prices them."""
    return latency.kernels_from_rows([asdict(k) for k in report.kernels])


def add_latency(report: Report, kernels: list[latency.Kernel],
                constants: latency.Constants = latency.FITTED) -> None:
    """Fill ``report.latency`` on CUDA: one inference launched kernel by kernel and under a CUDA
    graph, and the kernels' own time. ``kernels``: the report's kernels, in its order, as the
    build's facts give them to the model (``BuildFacts.cost_kernels``)."""
    if report.target != "cuda" or not report.kernels:
        return
    gpu = for_arch(report.arch or "sm_90")
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
