"""`make bench`: the paper's evaluation side by side, on this machine (2 cores, no GPU).

Three parts, one run, one JSON file (``results/bench-<date>/bench.json``), a Markdown table
and PNG plots beside it (``souffle_experiments/bench_plots.py``):

1. **Compile matrix** (cuda sm_90, full size unless ``--small``): every zoo model with
   ``--fusion tvm`` and the Souffle ablation levels V0 (no transforms, one kernel per group),
   V1 (+ horizontal), V2 (+ vertical), V3 (+ two-phase reductions, stitched cooperative
   kernels). Per configuration: launches per inference, distinct kernels, grid syncs, global
   bytes and flops (from the TIR's access regions), a roofline ESTIMATE of H200 latency
   (``souffle_tvm.report.roofline``), compile time (and nvcc's on its own), and per kernel
   (bytes, flops, launches) for the roofline plot. V4 (cross-stage optimisations: next-GEMM
   weight prefetch) is not built; the table says so.
2. **CPU side by side** (small variants, llvm): median latency of ``tvm``, ``souffle`` V2 and
   the V3 CPU twin (the same transforms without stitching) over repeated runs in one process,
   and onnxruntime's on the same ONNX model (the ``bench`` extra). Only ratios between these
   columns are claims; they are CPU figures, not the GPU's.
3. Outputs: JSON (date, TVM version, target, machine; for tvm, v3 and v3t one compact row per
   kernel, ``kernel_rows``, priced before/after where ``latency.BEFORE`` exists), Markdown, plots,
   and ``plausibility.md``/``.png`` (``souffle_experiments/bench_plausibility.py``).

    .venv/bin/python -m souffle_experiments bench [--models bert lstm] [--small] [--no-nvcc] [--no-cpu] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import tvm

from souffle_tvm import zoo
from souffle_tvm.cost import hardware, latency
from souffle_tvm.stitch import prefetch
from souffle_tvm.report import predicted, roofline
from souffle_tvm.pipeline.driver import compile as compile_model
from souffle_tvm.frontend.importer import import_onnx

from .paths import DATA, ROOT

# (key, fusion, level): the paper's ablation V0..V3 beside TVM's own fusion; V4 is derived from
# V3's build (``v4_from_v3``), not compiled again
CONFIGS = (("tvm", "tvm", None), ("v0", "souffle", "v0"), ("v1", "souffle", "v1"),
           ("v2", "souffle", "v2"), ("v3", "souffle", "v3"), ("v3t", "souffle", "v3"))
# Build options beyond fusion and level: TVM's kernels replayed from its CUDA graphs (the baseline a
# TVM user would choose) and the time-driven v3 (the default of `--fusion souffle` on CUDA)
EXTRA = {"tvm": {"cuda_graph": True}, "v3t": {"partitioner": "time"}}
CPU_CONFIGS = (("tvm", "tvm", None), ("v2", "souffle", "v2"), ("v3", "souffle", "v3"))
# Configurations whose kernels bench.json keeps one compact row each (``kernel_rows``), what
# souffle_experiments/bench_plausibility.py reads; v0-v2 keep only their (bytes, flops, launches) triples
PER_KERNEL = ("tvm", "v3", "v3t")


def constants_of(c) -> dict:
    """Every field of a ``latency.Constants`` (fitted and fixed), for the record."""
    return dataclasses.asdict(c)


def kernel_rows(report, gpu: hardware.GPU, before: latency.Constants | None) -> tuple[list[dict], float | None]:
    """One compact row per kernel of a CUDA ``report`` (souffle_experiments/bench_plausibility.py reads them):
    its form, launch shape, work and the latency model's ESTIMATES (``predicted_us`` under the
    fitted constants, as the report has them; ``before_us`` under ``before`` where given), and
    the inference's graph ms under ``before`` (None without it)."""
    times, graph_ms = None, None
    if before is not None and report.kernels:
        p = latency.predict(gpu, before, predicted.kernels_of(report), graphs=True)
        times, graph_ms = [t.seconds for t in p.kernels], round(p.seconds * 1e3, 4)
    rows = []
    for i, k in enumerate(report.kernels):
        row = {"name": k.name, "form": k.form, "measured_form": k.measured_form, "launches": k.launches,
               "grid": math.prod(k.grid or [1]), "threads": math.prod(k.block or [1]), "bytes": k.bytes,
               "flops": k.flops, "tensor_core": k.tensor_core, "elem_bytes": k.elem_bytes,
               "stitched": k.grid_syncs is not None and len(k.stages or []) > 1,
               "predicted_us": k.predicted_us, "floor_us": k.floor_us, "floor_by": k.floor_by}
        if times is not None:
            row["before_us"] = round(times[i] * 1e6, 4)
        rows.append(row)
    return rows, graph_ms


def v4_from_v3(c, gpu: hardware.GPU) -> dict:
    """V4 = V3's kernels plus L2 prefetches (``souffle_tvm.stitch.prefetch``), which change no launch,
    byte or flop these tables count: the V4 figures are V3's, plus what V4 would prefetch per
    inference, planned on V3's stitched kernels (compiling again would only repeat V3's build;
    ``compile --level v4`` builds it, tests/test_prefetch.py checks it is V3 plus prefetches)."""
    planned = 0
    for k in c.report.kernels:
        if k.grid_syncs is not None and k.primfunc in [gv.name_hint for gv in c.model.mod.functions]:
            planned += k.launches * sum(p.bytes for p in prefetch.plan(c.model.mod[k.primfunc], gpu.l2_bytes))
    return {"prefetched_bytes": planned, "derived_from": "v3"}


def compile_matrix(models: list[str], arch: str, small: bool, nvcc: bool, only: list[str] | None = None) -> list[dict]:
    """One row per model: every configuration's (or ``only`` these) launches, bytes, flops,
    estimates, times."""
    gpu = hardware.for_arch(arch)
    configs = [c for c in CONFIGS if not only or c[0] in only]
    rows, total, step = [], len(models) * len(configs), 0
    for name in models:
        dtype = zoo.MODELS[name].paper_dtype
        compulsory = roofline.compulsory_bytes(import_onnx(name, small=small, dtype=dtype))
        row = {"model": name, "dtype": dtype, "compulsory_bytes": compulsory}
        for key, fusion, level in configs:
            step += 1
            print(f"[{step}/{total}] {name} ({dtype}) {key} ...", end=" ", flush=True)
            t = time.perf_counter()
            try:
                # ptxas' register figures matter only where they decide something (TVM's kernels
                # and the stitched levels' feedback and grids); the ablation's v0-v2 skip them
                c = compile_model(name, "cuda", fusion, arch=arch, small=small, dtype=dtype,
                                  nvcc=nvcc and level not in ("v0", "v1", "v2"), level=level or "v2",
                                  **EXTRA.get(key, {}))
            except Exception as err:  # noqa: BLE001 - one failed build is a result, not the end of the run
                msg = str(err).strip().splitlines()
                row[key] = {"error": f"{type(err).__name__}: {msg[-1] if msg else ''}"[:300]}
                print(f"FAILED: {row[key]['error']}", flush=True)
                continue
            r = c.report
            est = roofline.estimate(r, gpu, dtype, compulsory)
            row["roofline_floor_ms_estimate"] = round(est.floor * 1e3, 4)
            lat = r.latency or {}
            row[key] = {"launches": r.launches, "distinct_kernels": r.distinct_kernels,
                        "grid_syncs": sum((k.grid_syncs or 0) * k.launches for k in r.kernels),
                        "stitched_stages": sum(len(k.stages or []) * k.launches for k in r.kernels
                                               if k.grid_syncs is not None and len(k.stages or []) > 1),
                        "bytes": r.bytes, "flops": r.flops,
                        "roofline_ms_estimate": round(est.seconds * 1e3, 4),
                        "predicted_ms": lat.get("ms"), "predicted_graph_ms": lat.get("graph_ms"),
                        "predicted_rewrite_ms": lat.get("rewrite_ms"), "cuda_graph": r.cuda_graph,
                        "compile_seconds": r.compile_seconds, "nvcc_seconds": r.nvcc.get("seconds"),
                        "total_seconds": round(time.perf_counter() - t, 2),
                        "kernels": [[k.bytes, k.flops, k.launches] for k in r.kernels]}
            if key in PER_KERNEL and r.target == "cuda":
                row[key]["kernel_rows"], row[key]["predicted_graph_ms_before"] = kernel_rows(r, gpu, latency.BEFORE)
            print(f"launches {r.launches}, {time.perf_counter() - t:.1f} s", flush=True)
            if key == "v3":
                row["v4"] = dict(row["v3"], **v4_from_v3(c, gpu))
        rows.append(row)
    return rows


def _median_ms(fn, reps: int, min_seconds: float = 0.5) -> float:
    fn()                                        # warm-up (first-call allocations, page faults)
    times = []
    t_end = time.perf_counter() + min_seconds
    while len(times) < reps or time.perf_counter() < t_end:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
        if len(times) >= 10 * reps:
            break
    return round(float(np.median(times)) * 1e3, 4)


def cpu_side_by_side(models: list[str], reps: int) -> list[dict]:
    """Small variants on llvm: median latency per configuration and onnxruntime's, one process."""
    import onnxruntime as ort
    from tvm import relax

    from souffle_tvm.runtime import numerics

    rows = []
    for name in models:
        dtype = "float32"           # the CPU twin runs fp32 (onnxruntime's CPU fp16 kernels are not the peer)
        row = {"model": name, "dtype": dtype}
        model = zoo.build(name, small=True, dtype=dtype)
        outputs = {}
        for key, fusion, level in CPU_CONFIGS:
            print(f"cpu {name} {key} ...", end=" ", flush=True)
            c = compile_model(model, "llvm", fusion, level=level or "v2")
            feeds = numerics.random_inputs(c.model.inputs, seed=0)
            vm = relax.VirtualMachine(c.executable, tvm.cpu())
            args = [tvm.runtime.tensor(feeds[i.name]) for i in c.model.inputs]
            args += [tvm.runtime.tensor(p) for p in c.model.params]
            f = vm["main"]
            outputs[key] = f(*args)
            row[key] = {"median_ms": _median_ms(lambda: f(*args), reps), "launches": c.report.launches}
            print(f"{row[key]['median_ms']:.3f} ms", flush=True)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = os.cpu_count() or 1
        sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        row["onnxruntime"] = {"median_ms": _median_ms(lambda: sess.run(None, feeds), reps),
                              "version": ort.__version__, "threads": opts.intra_op_num_threads}
        print(f"cpu {name} onnxruntime {row['onnxruntime']['median_ms']:.3f} ms", flush=True)
        rows.append(row)
    return rows


def markdown(result: dict) -> str:
    gpu = result["gpu_estimates_for"]
    lines = [f"# Benchmarks, {result['date']}", "",
             f"TVM {result['tvm']}, target {result['target']}, {result['machine']}. "
             f"Compiled at {'small' if result['small'] else 'full'} size. `est. ms` are roofline ESTIMATES for "
             f"{gpu} (souffle_tvm/report/roofline.py), not measurements; see docs/benchmarks.md.", "",
             *[f"Rebuilt later ({r['date']}, `--configs {' '.join(r['configs'])}`"
               + (f" `--models {' '.join(r['models'])}`" if r.get("models") else "")
               + "): those columns come from that run, the others from the first."
               for r in result.get("rebuilt", [])],
             "## Launches, bytes and estimated latency: TVM vs Souffle V3", "",
             "| model | dtype | launches tvm | v3 | tvm / v3 | grid syncs v3 | MB tvm | MB v3 | GFLOP | "
             "est. ms tvm | est. ms v3 | tvm / v3 est. | est. floor ms | compile s tvm | v3 (+nvcc) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["compile"]:
        t, v3 = r["tvm"], r["v3"]
        if "error" in t or "error" in v3:
            lines.append(f"| {r['model']} | {r['dtype']} | build failed: {(t.get('error') or v3.get('error'))[:80]} |")
            continue
        lines.append(
            f"| {r['model']} | {r['dtype']} | {t['launches']} | {v3['launches']} | "
            f"{t['launches'] / max(v3['launches'], 1):.1f}x | {v3['grid_syncs']} | {t['bytes'] / 1e6:.1f} | "
            f"{v3['bytes'] / 1e6:.1f} | {v3['flops'] / 1e9:.2f} | {t['roofline_ms_estimate']:.3f} | "
            f"{v3['roofline_ms_estimate']:.3f} | {t['roofline_ms_estimate'] / v3['roofline_ms_estimate']:.2f}x | "
            f"{r['roofline_floor_ms_estimate']:.3f} | {t['compile_seconds']:.1f} (+{t['nvcc_seconds'] or 0:.1f}) | "
            f"{v3['compile_seconds']:.1f} (+{v3['nvcc_seconds'] or 0:.1f}) |")
    lines += _latency_lines(result)
    lines += ["", "## Ablation: launches / MB / est. ms per level", "",
              "V0 no transforms; V1 + horizontal; V2 + vertical; V3 + two-phase reductions and stitching; "
              "V4 + L2 prefetch of each stitched kernel's next-segment inputs. V4 has V3's kernels, so its "
              "launches, bytes and roofline estimate are V3's (a roofline already assumes a kernel's loads "
              "overlap): its column gives the MB it would prefetch per inference (planned on V3's kernels; a V4 build drops the prefetch of any kernel ptxas finds over budget with it), whose effect only a GPU "
              "measures.", "",
              "| model | tvm | V0 | V1 | V2 | V3 | V3t | V4 MB prefetched |", "|---|---|---|---|---|---|---|---|"]
    for r in result["compile"]:
        cells = [f"build failed: {r[k]['error'][:60]}" if "error" in r[k] else
                 f"{r[k]['launches']} / {r[k]['bytes'] / 1e6:.1f} / {r[k]['roofline_ms_estimate']:.3f}"
                 for k, _, _ in CONFIGS]
        v4 = r.get("v4")
        cells.append(f"{v4['prefetched_bytes'] / 1e6:.1f}" if v4 else "-")
        lines.append(f"| {r['model']} | " + " | ".join(cells) + " |")
    if result.get("cpu"):
        lines += ["", "## CPU side by side (small variants, llvm, fp32; median ms, one process)", "",
                  "| model | tvm | souffle v2 | souffle v3 twin | onnxruntime | tvm / v2 | tvm / v3 | ort / v3 |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in result["cpu"]:
            t, v2, v3, o = (r[k]["median_ms"] for k in ("tvm", "v2", "v3", "onnxruntime"))
            lines.append(f"| {r['model']} | {t:.3f} | {v2:.3f} | {v3:.3f} | {o:.3f} | {t / v2:.2f} | {t / v3:.2f} "
                         f"| {o / v3:.2f} |")
        lines += ["", "Ratios above 1 mean the right-hand configuration is faster."]
    if result.get("plots"):
        lines += ["", "## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in result["plots"]]
    lines += ["", "Per kernel (tvm, v3, v3t): the latency model's re-pricing before/after its latest terms and each "
              "kernel's predicted rate as a fraction of the GPU's peak, in plausibility.md (`python -m souffle_experiments bench-plausibility`)."]
    return "\n".join(lines) + "\n"


def _latency_lines(result: dict) -> list[str]:
    """Predicted GPU time (the latency model, docs/latency-model.md): an ESTIMATE per model for
    tvm launched one by one, tvm with its CUDA-graph rewriting, tvm in one captured graph, v2,
    v3 (budget) and the time-driven v3, with the ratio that matters and the validation summary."""
    lines = ["", f"## Predicted GPU time (latency model, ESTIMATES for {result['gpu_estimates_for']}, ms)", "",
             "Launched one by one / under CUDA graphs. `tvm rw`: TVM's kernels built with its CUDA-graph "
             "rewriting (kernels on model inputs and outputs stay launches). `v3t`: the time-driven "
             "partitioner. Ratio: v3t under one graph over tvm under one graph (below 1: predicted faster).",
             "", "| model | tvm | tvm rw | tvm graph | v2 graph | v3 graph | v3t | v3t graph | v3t / tvm graph | "
             "floor | launches tvm / v3 / v3t | stitched stages v3 / v3t |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["compile"]:
        k = {c: r.get(c, {}) for c in ("tvm", "v2", "v3", "v3t")}
        k = {c: {} if str(v.get("error", "")).startswith("not built") else v for c, v in k.items()}
        if any("error" in v or (v and v.get("predicted_ms") is None) for v in k.values()) or not all(
                k[c] for c in ("tvm", "v3", "v3t")):
            lines.append(f"| {r['model']} | not predicted (a build failed, or tvm/v3/v3t not built) |")
            continue
        t, v2, v3, vt = k["tvm"], k["v2"], k["v3"], k["v3t"]
        v2_graph = f"{v2['predicted_graph_ms']:.3f}" if v2 else "not built"
        lines.append(
            f"| {r['model']} | {t['predicted_ms']:.3f} | {t['predicted_rewrite_ms'] or float('nan'):.3f} | "
            f"{t['predicted_graph_ms']:.3f} | {v2_graph} | {v3['predicted_graph_ms']:.3f} | "
            f"{vt['predicted_ms']:.3f} | {vt['predicted_graph_ms']:.3f} | "
            f"{vt['predicted_graph_ms'] / t['predicted_graph_ms']:.2f} | {r['roofline_floor_ms_estimate']:.3f} | "
            f"{t['launches']} / {v3['launches']} / {vt['launches']} | {v3['stitched_stages']} / {vt['stitched_stages']} |")
    validation = DATA / "latency" / "validation.md"
    if validation.exists():
        summary = next((ln for ln in validation.read_text().splitlines() if ln.startswith("All points")), "")
        lines += ["", f"Validation against the measured GPU runs (data/latency/validation.md): {summary}"]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="*", default=zoo.names())
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--small", action="store_true", help="compile matrix at small size (a quick smoke run)")
    ap.add_argument("--no-nvcc", action="store_true", help="skip ptxas (faster; no register figures)")
    ap.add_argument("--no-cpu", action="store_true", help="skip the CPU side-by-side timings")
    ap.add_argument("--reps", type=int, default=30, help="CPU timing: runs per configuration (at least 0.5 s)")
    ap.add_argument("--out", default=None, help="output folder (default results/bench-<date>)")
    ap.add_argument("--configs", nargs="*", default=None, choices=[c[0] for c in CONFIGS],
                    help="rebuild only these configurations into an existing --out (the others are kept)")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    stamp = datetime.date.today().isoformat()
    out = Path(args.out or ROOT / "results" / f"bench-{stamp}{'-small' if args.small else ''}")
    out.mkdir(parents=True, exist_ok=True)
    result = {"date": stamp, "tvm": tvm.__version__, "target": f"cuda -arch={args.arch}", "small": args.small,
              "machine": f"{os.cpu_count()} CPU cores, no GPU (compile only; CPU timings on llvm)",
              "gpu_estimates_for": hardware.for_arch(args.arch).name,
              # the latency model's constants the predicted figures use, and (``latency.BEFORE``, where
              # defined) those of the model before its latest terms: the ``*_before`` figures
              "latency_constants": constants_of(latency.FITTED)}
    result["latency_constants_before"] = constants_of(latency.BEFORE)
    fresh = compile_matrix(args.models, args.arch, args.small, not args.no_nvcc, args.configs)
    old = out / "bench.json"
    if args.configs and old.exists():       # replace those configurations in the earlier result
        kept = json.loads(old.read_text())
        by_model = {r["model"]: r for r in fresh}
        for r in kept["compile"]:
            r.update({k: v for k, v in by_model.get(r["model"], {}).items() if k in args.configs})
        rebuilt = {"configs": args.configs, "date": stamp}
        if sorted(by_model) != sorted(r["model"] for r in kept["compile"]):
            rebuilt["models"] = sorted(by_model)
        for name in ("latency_constants", "latency_constants_before"):      # the rebuilt columns' model, if another
            if name in result and result[name] != kept.get(name):
                rebuilt[name] = result[name]
        kept.setdefault("rebuilt", []).append(rebuilt)
        result = kept | {"plots": None}
        result["compile"] = kept["compile"]
    else:
        result["compile"] = fresh
        for r in fresh if args.configs else []:      # a first run of some configurations: the others are absent
            r.update({k: {"error": f"not built (--configs {' '.join(args.configs)})"}
                      for k, _, _ in CONFIGS if k not in r})
    if not args.no_cpu:
        result["cpu"] = cpu_side_by_side(args.models, args.reps)
    if result.get("rebuilt") and args.configs:
        result["rebuilt"][-1]["seconds"] = round(time.perf_counter() - t0, 1)
    else:
        result["seconds"] = round(time.perf_counter() - t0, 1)
    (out / "bench.json").write_text(json.dumps(result, indent=1))
    try:
        from . import bench_plots

        result["plots"] = [str(p) for p in bench_plots.plot_all(result, out)]
    except ImportError as err:          # matplotlib is in the bench extra
        print(f"no plots: {err} (pip install -e '.[bench]')", flush=True)
    except ValueError as err:           # matplotlib on a partial first run: the plots need tvm, v2, v3 and v3t
        if not args.configs:
            raise
        print(f"no plots for --configs {' '.join(args.configs)}: {err}", flush=True)
    (out / "bench.json").write_text(json.dumps(result, indent=1))
    from . import bench_plausibility       # re-pricing (before/after) and fraction-of-peak check: plausibility.md, .png

    bench_plausibility.main([str(out / "bench.json")])
    (out / "README.md").write_text(markdown(result))
    print(markdown(result))
    print(f"wrote {out}/ in {result['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
