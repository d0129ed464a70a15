"""Rebuild the builds the GPU runs measured, at the commit they came from, and write their
kernel plans (what the latency model reads) to ``data/latency/plans-<commit>.json``.

The measured runs (data/gpu/, 2026-11-29) used the flat layout of those days
(``souffle_tvm.api``, ``souffle_tvm.stitch``): this script runs with that tree first on
``sys.path`` and records, per stitched kernel, each stage's tiles, threads, bytes and flops by
wrapping the old ``stitch.lower_stage`` and ``stitch.stitch``. Nothing of today's package is
imported, so the plans describe exactly the kernels that ran.

    git worktree add /tmp/old3 44fa44f
    PYTHONPATH=/tmp/old3 .venv/bin/python -P -m souffle_experiments replay --commit 44fa44f \\
        --out data/latency/plans-44fa44f.json

``-P`` keeps the working directory off ``sys.path`` (``-m`` would put it first), so the old tree on
``PYTHONPATH`` is the ``souffle_tvm`` imported.

Each case's launch and grid-sync counts are compared with the measured run's
``launches_compiled`` and ``grid_syncs`` by ``souffle_experiments/latency_fit.py``: a mismatch means the
rebuild is not the build that ran.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

MODELS = ["mmoe", "lstm", "efficientnet", "bert", "resnext", "swin"]
ARCH = "sm_90"
_TC = re.compile(r"\b(wmma|mma\.sync|ldmatrix|mma_sync)\b")


def _kernel_sources(cuda: str | None) -> dict[str, str]:
    """CUDA source text of each ``__global__`` function, by name."""
    if not cuda:
        return {}
    out = {}
    parts = re.split(r'(?=extern "C" __global__)', cuda)
    for p in parts:
        m = re.search(r"__global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\(", p)
        if m:
            out[m.group(1)] = p
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commit", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", nargs="+", default=MODELS)
    ap.add_argument("--sizes", nargs="+", default=["small", "full"])
    ap.add_argument("--fusions", nargs="+", default=["tvm", "souffle"])
    ap.add_argument("--redo", action="store_true", help="rebuild cases already in --out")
    args = ap.parse_args(argv)

    from souffle_tvm import build_tvm, stitch, tir_stats, zoo
    from souffle_tvm.api import compile as compile_model

    stage_facts: dict[str, dict] = {}
    stitched: list[dict] = []
    lower_stage, stitch_fn = stitch.lower_stage, stitch.stitch

    def recording_lower_stage(name, func, target):
        stage_facts[name] = {"bytes": tir_stats.primfunc_param_bytes(func),
                             "flops": sum(tir_stats.block_flops(func).values()),
                             "tensor_core": bool(_TC.search(func.script()) or "wmma" in func.script())}
        return lower_stage(name, func, target)

    def recording_stitch(stages, args_, grid, block, name="souffle_kernel", target=None, param_keys=None):
        func, syncs = stitch_fn(stages, args_, grid, block, name=name, target=target, param_keys=param_keys)
        rows, written = [], {}
        for st, keys, sync in zip(stages, args_, syncs):
            base = st.name.split(".")[0]
            read, wrote = stitch._param_access(st)
            nbytes = {k: tir_stats.buffer_bytes(p) for p, k in zip(st.params, keys)}
            produced = sum(nbytes[k] for r, k in zip(read, keys) if r and k in written)
            facts = stage_facts.get(base, {})
            rows.append({"name": st.name, "tiles": st.num_blocks, "threads": st.num_threads, "sync_before": bool(sync),
                         "bytes": sum(nbytes[k] for r, w, k in zip(read, wrote, keys) if r or w),
                         "written_bytes": sum(nbytes[k] for w, k in zip(wrote, keys) if w),
                         "reads_produced_bytes": produced, "flops": facts.get("flops", 0),
                         "tensor_core": facts.get("tensor_core", False)})
            written.update({k: True for w, k in zip(wrote, keys) if w})
        stitched.append({"name": name, "grid": grid, "block": block, "stages": rows})
        return func, syncs

    written_by_kernel: dict[str, int] = {}
    build = build_tvm.build

    def recording_build(*a, **kw):
        result = build(*a, **kw)
        written_by_kernel.clear()     # the last build is the one that ran (grids widened by ptxas)
        for k in result.kernels:
            written_by_kernel[k.name] = sum(v for n, v in k.global_buffers.items() if n in k.stored)
        return result

    stitch.lower_stage, stitch.stitch, build_tvm.build = recording_lower_stage, recording_stitch, recording_build
    out = {"commit": args.commit, "arch": ARCH, "cases": []}
    path = Path(args.out)
    if path.exists():
        out = json.loads(path.read_text())
    if args.redo:
        out["cases"] = [c for c in out["cases"] if c["model"] not in args.models]
    done = {c["id"] for c in out["cases"]}
    for name in args.models:
        for size in args.sizes:
            for fusion in args.fusions:
                case_id = f"{name}-{size}-{fusion}"
                if case_id in done:
                    continue
                t = time.perf_counter()
                print(f"{case_id} ...", flush=True)
                stage_facts.clear()
                stitched.clear()
                c = compile_model(name, "cuda", fusion, arch=ARCH, small=size == "small",
                                  dtype=zoo.MODELS[name].paper_dtype, level="v3")
                sources = _kernel_sources(c.cuda_source)
                by_name = {s["name"]: s for s in stitched}
                kernels = []
                for k in c.report.kernels:
                    src = sources.get(k.name) or sources.get(k.name + "_kernel") or ""
                    row = {"name": k.name, "launches": k.launches, "grid": k.grid, "block": k.block,
                           "registers": k.registers, "shared_bytes": k.shared_bytes, "spill_bytes": k.spill_bytes,
                           "cooperative": k.cooperative, "grid_syncs": k.grid_syncs or 0,
                           "bytes": k.bytes, "flops": k.flops, "tensor_core": bool(_TC.search(src)),
                           "written_bytes": written_by_kernel.get(k.name)}
                    sk = by_name.get(k.primfunc) or by_name.get(k.name.removesuffix("_kernel"))
                    if sk is not None:
                        row["stages"] = sk["stages"]
                    elif k.cooperative:
                        raise SystemExit(f"{case_id}: stitched kernel {k.name} has no recorded stages")
                    kernels.append(row)
                out["cases"].append({
                    "id": case_id, "model": name, "size": size, "fusion": fusion,
                    "dtype": zoo.MODELS[name].paper_dtype, "launches": c.report.launches,
                    "grid_syncs": sum((k.grid_syncs or 0) * k.launches for k in c.report.kernels),
                    "compile_seconds": round(time.perf_counter() - t, 1), "kernels": kernels})
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(out, indent=1))
                print(f"    {c.report.launches} launches, {len(kernels)} kernels, "
                      f"{time.perf_counter() - t:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
