"""The GPU check: build here, run on a lent H200 with the TVM runtime alone.

Two halves, so that device time is spent only on running:

``prepare`` (this machine: TVM, nvcc, no GPU) compiles the six zoo models, small and full
size, with ``--fusion tvm`` and ``--fusion souffle`` (level v3: stitched cooperative
kernels) for ``cuda -arch=sm_90``; exports each library; compiles every CUDA module to a
cubin (the runtime JIT-compiles module *source* otherwise); writes weights that cannot be
regenerated on the device, seeded inputs and onnxruntime references for the small models,
and a cooperative-launch probe (a two-stage kernel with a cross-block dependence). Output:
``gpu_bundle/`` (ignored by git; about 30 MB) with ``manifest.json``.

``run`` (the device: Python 3.12, torch, onnxruntime, no TVM) loads TVM's runtime libraries
and each library (``souffle_tvm.runtime.standalone``), and for every case: numerics against the
reference (small: onnxruntime here; full: onnxruntime there on the zoo's ONNX, regenerated
from its seed, where every weight is known), outputs NaN-poisoned through the memory pool
before the checked run; median latency with CUDA events, with and without a CUDA graph;
kernels per inference from the profiler's trace. Probes: a cooperative grid at the
co-resident limit runs and is right; one block per SM more is refused with an error (in a
subprocess with a timeout, so a hang could not eat the lease); the same kernel without its
grid sync; the same kernel built as the pass form with TVM's default TIR pipeline (no
cooperative flag), whose entry check must trap instead of hanging. Occupancy of each stitched kernel from ``cudaOccupancyMaxActiveBlocksPerMultiprocessor``
against ``souffle_tvm.cost.hardware``. Results: ``$OUT/gpu_check.json`` and a table.

    .venv/bin/python -m souffle_experiments gpu-check prepare [--models bert mmoe] [--sizes small full]
    PYTHONPATH=python python3 -m souffle_experiments gpu-check run --bundle gpu_bundle --out $OUT   # the device
    PYTHONPATH=python python3 -m souffle_experiments gpu-check tests --bundle gpu_bundle            # its gpu tests

On the device the bundle travels as ``gpu_bundle.tgz`` (see docs/gpu-check.md for the command).
The device has the checkout but not this package installed: ``PYTHONPATH=python`` finds it, and
``-m`` puts the checkout's root (the working directory) first on ``sys.path`` for ``souffle_tvm``;
``run`` needs only this module, ``paths`` and ``souffle_tvm``'s TVM-free ``zoo``,
``runtime.numerics`` and ``runtime.standalone``.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

# tvm_ffi would otherwise JIT-build a torch extension (minutes) on first import next to torch
os.environ.setdefault("TVM_FFI_DISABLE_TORCH_C_DLPACK", "1")

from souffle_tvm import zoo  # noqa: E402 - none of these imports tvm
from souffle_tvm.runtime import numerics  # noqa: E402
from souffle_tvm.runtime import standalone  # noqa: E402

from .paths import ROOT, child_env  # noqa: E402

ARCH = "sm_90"
# this module in a child process (the probes, ncu's one inference): by module name, never by
# file path, so its relative imports resolve; child_env() puts its package on PYTHONPATH
SELF = (sys.executable, "-m", __spec__.name if __spec__ else "souffle_experiments.gpu_check")


def _digest(a: np.ndarray) -> str:
    a = np.ascontiguousarray(a)
    return hashlib.sha256(a.dtype.str.encode() + str(a.shape).encode() + a.tobytes()).hexdigest()[:24]


# == prepare (build machine) ======================================================================
def prepare(args) -> int:
    import tvm
    from onnx import numpy_helper

    from souffle_tvm.cost import hardware
    from souffle_tvm.pipeline.driver import compile as compile_model

    out = Path(args.bundle)
    (out / "libs").mkdir(parents=True, exist_ok=True)
    (out / "data").mkdir(exist_ok=True)
    store = standalone.CubinStore(out / "cubins", ARCH)
    manifest = {"arch": ARCH, "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "tvm": tvm.__version__, "cases": [], "probes": []}
    if args.add and (out / "manifest.json").exists():   # grow an existing bundle, case by case
        manifest["cases"] = json.loads((out / "manifest.json").read_text())["cases"]
    _copy_runtime(out)
    if not args.no_wheel:
        _fetch_ffi_wheel(out / "wheels")
    manifest["probes"] = _build_probes(out, store)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))     # a probes-only bundle is one too
    gpu = hardware.for_arch(ARCH)
    carried = 0
    steps = _steps(args)
    for n, (name, dtype, size, variant) in enumerate(steps, 1):
        small = size == "small"
        fusion, _, level = variant.partition("-")
        extra = VARIANT_OPTIONS.get(variant, {})
        level = {"graph": "", "time": "v3"}.get(level, level) or ("v3" if fusion == "souffle" else "")
        tag = name if dtype == zoo.MODELS[name].paper_dtype else f"{name}-{'fp32' if dtype == 'float32' else 'fp16'}"
        case_id = f"{tag}-{size}-{variant}"
        print(f"[{n}/{len(steps)}] {case_id} ({dtype}) ...", flush=True)
        t = time.perf_counter()
        c = compile_model(name, "cuda", fusion, arch=ARCH, small=small, dtype=dtype, level=level or "v2", **extra)
        lib = out / "libs" / f"{case_id}.so"
        c.executable.export_library(str(lib))
        if c.cuda_source:
            store.add(c.cuda_source)        # compiled once already, for the report's figures
        onnx_model = c.model.onnx_model
        by_digest = {_digest(numpy_helper.to_array(i)): i.name for i in onnx_model.graph.initializer}
        params, to_carry = [], {}
        for i, p in enumerate(c.model.params):
            spec = {"shape": list(p.shape), "dtype": str(p.dtype)}
            d = _digest(p)
            if d in by_digest:          # an initializer as exported: regenerated on the device
                spec.update(src="onnx", name=by_digest[d], digest=d)
            else:                       # transformed at compile time (folded, concatenated...)
                spec.update(src="npz", key=f"p{i:05d}")
                to_carry[spec["key"]] = p
            params.append(spec)
        need = sum(p.nbytes for p in to_carry.values())
        if not small and carried + need > args.carry_mib * 2**20:
            # all or nothing: a case with one stand-in weight cannot be checked anyway
            for spec in params:
                if spec["src"] == "npz":
                    spec["src"] = "random"
            to_carry = {}
        elif not small:
            carried += need
        case = {"id": case_id, "model": name, "size": size, "fusion": fusion, "level": level or None,
                "variant": variant, "dtype": dtype,
                "lib": str(lib.relative_to(out)), "params": params,
                "inputs": [{"name": i.name, "shape": list(i.shape), "dtype": i.dtype} for i in c.model.inputs],
                "outputs": list(c.model.outputs),
                "report": _summary(c.report, gpu, store.path(c.cuda_source).name if c.cuda_source else None,
                                   c.model.mod)}
        if to_carry:
            path = out / "data" / f"{case_id}.params.npz"
            np.savez(path, **to_carry)
            case["params_npz"] = str(path.relative_to(out))
        if small:
            io = out / "data" / f"{tag}-small.io.npz"
            if not io.exists():
                feeds = numerics.random_inputs(c.model.inputs, seed=0)
                ref_name, ref = numerics.reference_outputs(onnx_model, feeds)
                np.savez(io, **{f"in_{k}": v for k, v in feeds.items()},
                         **{f"ref_{i}": r for i, r in enumerate(ref)})
            case["io_npz"] = str(io.relative_to(out))
        manifest["cases"] = [c for c in manifest["cases"] if c["id"] != case_id] + [case]
        print(f"    launches {c.report.launches}, {time.perf_counter() - t:.1f} s", flush=True)
        (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    tgz = pack(out)
    print(f"bundle {out}: {size / 2**20:.1f} MiB ({tgz.stat().st_size / 2**20:.1f} MiB as {tgz.name}), "
          f"{len(manifest['cases'])} cases, {carried / 2**20:.1f} MiB of full-size weights carried", flush=True)
    _, over = travel_check(tgz)
    if over:
        print(f"ERROR: {over}", flush=True)
        return 1
    return 0


VARIANTS = ("tvm", "souffle", "tvm-graph", "souffle-time", "souffle-v4", "souffle-v2", "souffle-v1", "souffle-v0")
# tvm-graph: TVM's kernels built with its CUDA-graph rewriting (the baseline a TVM user would
# choose); souffle-time: v3 with the time-driven partitioner (docs/latency-model.md)
VARIANT_OPTIONS = {"tvm-graph": {"cuda_graph": True}, "souffle-time": {"partitioner": "time"}}


def _steps(args) -> list[tuple[str, str, str, str]]:
    """(model, dtype, size, variant) to build: every model at its paper dtype, plus float32 for
    the models named in --fp32; the ablation levels (souffle-v0..v2) only at --ablation-sizes."""
    steps = []
    for name in args.models:
        dtypes = [zoo.MODELS[name].paper_dtype]
        if name in args.fp32 and "float32" not in dtypes:
            dtypes.append("float32")
        for dtype in dtypes:
            for size in args.sizes:
                for variant in args.fusions:
                    ablation = variant.startswith("souffle-v")
                    if ablation and size not in args.ablation_sizes:
                        continue
                    if dtype != zoo.MODELS[name].paper_dtype and ablation:
                        continue
                    steps.append((name, dtype, size, variant))
    return steps


# What one device call carries: the repository's tracked and untracked-not-ignored files with the
# carried paths (the bundle's .tgz), together.
TRAVEL_LIMIT = 64 * 2**20


def tree_bytes(root: Path = ROOT) -> int:
    """Bytes of the working tree that travels with every device call (git's tracked and
    untracked-not-ignored files); 0 outside a git checkout."""
    try:
        names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                               capture_output=True, check=True).stdout.split(b"\0")
    except (OSError, subprocess.CalledProcessError):
        return 0
    paths = {root / n.decode() for n in names if n}
    return sum(p.stat().st_size for p in paths if p.is_file())


def travel_check(tgz: Path) -> tuple[int, str | None]:
    """(the tree's bytes, None) when ``tgz`` and the working tree fit one device call together;
    else with what is over."""
    tree = tree_bytes()
    total = tree + tgz.stat().st_size
    if total <= TRAVEL_LIMIT:
        return tree, None
    return tree, (f"{tgz.name} ({tgz.stat().st_size / 2**20:.1f} MiB) with the working tree ({tree / 2**20:.1f} MiB) "
                  f"is {total / 2**20:.1f} MiB, over the {TRAVEL_LIMIT / 2**20:.0f} MiB one device call carries")


def pack(bundle: Path) -> Path:
    """One gzipped tar beside the bundle: the libraries carry CUDA source, which shrinks ~9x,
    and the device tool carries at most 64 MiB."""
    import tarfile

    tgz = bundle.parent / f"{bundle.name}.tgz"
    with tarfile.open(tgz, "w:gz", compresslevel=6) as tar:
        tar.add(bundle, arcname=bundle.name)
    return tgz


def _summary(report, gpu, cubin: str | None, mod=None) -> dict:
    """The build as the GPU run and the latency model see it: per kernel its launch, resources,
    the model's predicted time of one launch (``predicted_us``, committed before the run) and its
    key in the measured-times database (``cost.measured``; kernels of one PrimFunc each)."""
    from dataclasses import asdict

    from souffle_tvm.cost import latency, measured
    from souffle_tvm.report import predicted

    funcs = {gv.name_hint: f for gv, f in mod.functions.items()} if mod is not None else {}
    per_func = {}
    for k in report.kernels:
        per_func[k.primfunc] = per_func.get(k.primfunc, 0) + 1

    times = {k.name: latency.kernel_time(gpu, latency.FITTED, k).seconds for k in predicted.kernels_of(report)}
    kernels = []
    seen = set()
    for k in report.kernels:
        if k.name in seen:
            continue
        seen.add(k.name)
        kernels.append({"name": k.name, "grid": k.grid, "block": k.block, "registers": k.registers,
                        "shared_bytes": k.shared_bytes, "cooperative": k.cooperative,
                        "grid_syncs": k.grid_syncs, "launches": k.launches, "cubin": cubin,
                        # the build's own co-residency check (cooperative kernels only)
                        "predicted_blocks_per_sm": k.max_coresident // gpu.sms if k.max_coresident else None,
                        "predicted_us": round(times[k.name] * 1e6, 3),
                        # what the model priced it from: a measured time refits the model (latency_fit.py)
                        "inputs": latency.row_inputs(asdict(k)), "form": k.form,
                        "key": measured.kernel_key(funcs[k.primfunc], ARCH, math.prod(k.grid), math.prod(k.block))
                        if per_func[k.primfunc] == 1 and hasattr(funcs.get(k.primfunc), "body") else None})
    return {"launches": report.launches, "distinct_kernels": report.distinct_kernels,
            "predicted": report.latency, "cuda_graph": report.cuda_graph,
            "grid_syncs": sum((k.grid_syncs or 0) * k.launches for k in report.kernels),
            "compile_seconds": report.compile_seconds, "fallback": report.fallback, "kernels": kernels}


def _copy_runtime(out: Path) -> None:
    import shutil

    rt = out / "runtime"
    rt.mkdir(exist_ok=True)
    src = standalone.installed_runtime_dir()
    for name in standalone.RUNTIME_LIBS + standalone.CUDA_RUNTIME_LIBS:
        shutil.copy2(src / name, rt / name)
    # libtvm_runtime_cuda.so links libcudart.so.13: carry the one it was built against
    import ctypes.util

    found = [Path(p) for p in ("/usr/local/cuda/lib64/libcudart.so.13", "/usr/local/cuda-13.0/lib/libcudart.so.13",
                               "/usr/local/cuda-13.0/lib64/libcudart.so.13") if Path(p).exists()]
    if found:
        shutil.copy2(found[0].resolve(), rt / "libcudart.so.13")
    elif ctypes.util.find_library("cudart") is None:
        print("note: libcudart.so.13 not found here; the device's own will be used", flush=True)


def _fetch_ffi_wheel(dest: Path) -> None:
    """The device's Python is 3.12: fetch the matching apache-tvm-ffi wheel once (PyPI), and
    pytest's (pure Python, with its dependencies) for `gpu-check tests` where the device lacks it."""
    import importlib.metadata

    version = importlib.metadata.version("apache-tvm-ffi")
    wanted = [("apache_tvm_ffi-*-cp312-*.whl", [f"apache-tvm-ffi=={version}", "--no-deps", "--implementation", "cp",
                                               "--platform", "manylinux_2_28_x86_64",
                                               "--platform", "manylinux_2_17_x86_64"]),
              ("pytest-*.whl", ["pytest"])]
    for pattern, spec in wanted:
        if list(dest.glob(pattern)):
            continue
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--python-version", "3.12",
               "-d", str(dest), *spec]
        if subprocess.run(cmd, capture_output=True).returncode != 0:
            print(f"note: could not download {spec[0]} for cp312 into {dest}; "
                  "put it there before running on the device", flush=True)


def _build_probes(out: Path, store) -> list[dict]:
    """Two-stage cooperative kernels: B = A + 1; C[i] = 2 * B[(i + shift) % n] with shift over a
    block, so every block reads what other blocks wrote. Grids: the co-resident limit (from
    ptxas' registers and the hardware table), one block per SM over it, and the limit again
    without the grid sync."""
    from souffle_tvm.cost import hardware

    gpu = hardware.for_arch(ARCH)
    block = 1024
    first = _build_probe(out, store, "measure", gpu.sms, block)    # resources do not depend on the grid
    per_sm = first["predicted_blocks_per_sm"]
    (out / first["lib"]).unlink()
    return [_build_probe(out, store, kind, gpu.sms * (per_sm + (kind == "oversized")), block)
            for kind in PROBES]


# noflag: the pass form's entry check (``build.cooperative.guard_grid_sync``) built with TVM's
# default TIR pipeline, so launched without the cooperative flag: it must trap, not hang
PROBES = ("coresident", "oversized", "nosync", "noflag")


def two_stage_kernel(grid: int, block: int, shift: int, name: str, sched_target=None):
    """The probes' stitched kernel: B = A + 1, then C[i] = 2 * B[(i + shift) % n] (n = 2 x grid x
    block), each stage scheduled by dlight's Fallback (on ``sched_target``, default the CUDA
    target) and stitched into one ``grid`` x ``block`` launch with a grid sync between them.
    Returns (the stitched PrimFunc, the target, n); ``microbench`` reuses it for its probes."""
    import tvm
    from tvm import te, tirx
    from tvm.s_tir import dlight as dl

    from souffle_tvm.core.targets import make_target
    from souffle_tvm.stitch import kernel, lower

    target = make_target("cuda", ARCH)
    n = grid * block * 2
    A = te.placeholder((n,), "float32", "A")
    B = te.compute((n,), lambda i: A[i] + tirx.const(1.0, "float32"), "B")
    Bp = te.placeholder((n,), "float32", "Bp")
    C = te.compute((n,), lambda i: Bp[(i + shift) % n] * tirx.const(2.0, "float32"), "C")
    stages = []
    for k, tensors in enumerate(([A, B], [Bp, C])):
        mod = tvm.IRModule({"main": te.create_prim_func(tensors)})
        with sched_target or target:
            mod = dl.ApplyDefaultSchedule(dl.gpu.Fallback())(mod)
        stages += lower.lower_stage(f"s{k}", mod["main"], target)
    func = kernel.stitch(stages, [["A", "B"], ["B", "C"]], grid, block, name=name, target=target)[0]
    return func, target, n


def export_probe(out: Path, store, name: str, func, target, pipeline, block: int) -> dict:
    """Build one probe kernel, export its library under ``out/libs`` and measure it with ptxas
    (its cubin kept in ``store``: no second nvcc): the manifest fields every probe carries."""
    import tvm

    from souffle_tvm.build import ptxas as resources
    from souffle_tvm.cost import hardware

    lib = tvm.tirx.build(tvm.IRModule({name: func}), target, pipeline=pipeline)
    path = out / "libs" / f"{name}.so"
    lib.export_library(str(path))
    src = "\n".join(m.inspect_source() for m in lib.imports if m.kind == "cuda")
    res = resources.measure(src, ARCH)
    store.add(src)                      # the cubin measure compiled: no second nvcc
    kname = next(iter(res))
    occ = hardware.occupancy(hardware.for_arch(ARCH), block, res[kname].registers, res[kname].shared_bytes)
    return {"lib": str(path.relative_to(out)), "func": name, "kernel": kname, "cubin": store.path(src).name,
            "registers": res[kname].registers, "predicted_blocks_per_sm": occ.blocks_per_sm}


def _build_probe(out: Path, store, kind: str, grid: int, block: int) -> dict:
    import tvm

    from souffle_tvm.build import executable as build_tvm
    from souffle_tvm.stitch import kernel_ir

    name, shift = f"probe_{kind}", block * 3 + 1
    func, target, n = two_stage_kernel(grid, block, shift, name)
    if kind == "nosync":
        func = _without_grid_syncs(func)
    pipeline = build_tvm.TIR_PIPELINE
    if kind == "noflag":
        from souffle_tvm.build import cooperative

        func = cooperative.guard_grid_sync(tvm.IRModule({name: func}))[0][name]
        pipeline = "default"
    built = export_probe(out, store, name, func, target, pipeline, block)
    return {"name": name, "kind": kind, **built, "grid": grid, "block": block, "n": n, "shift": shift,
            "grid_sync": kernel_ir.has_grid_sync(func), "cooperative": kind != "noflag"}


def _without_grid_syncs(func):
    from souffle_tvm.stitch import kernel_ir

    return kernel_ir.replace_stages(func, [s for s in kernel_ir.stage_loops(func) if not kernel_ir.is_grid_sync(s)])


# == run (device) =================================================================================
class Deadline:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def run(args) -> int:
    bundle = Path(args.bundle)
    manifest = json.loads((bundle / "manifest.json").read_text())
    outdir = Path(args.out or ".")
    outdir.mkdir(parents=True, exist_ok=True)
    deadline = Deadline(args.budget)
    import torch
    import tvm_ffi

    standalone.load_runtime(bundle / "runtime", cuda=True)
    store = standalone.CubinStore(bundle / "cubins", manifest["arch"])
    store.register()
    props = torch.cuda.get_device_properties(0)
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "gpu": torch.cuda.get_device_name(0), "sms": props.multi_processor_count,
              "torch": torch.__version__, "tvm_ffi": tvm_ffi.__version__, "bundle": manifest["created"],
              "tvm_build": manifest["tvm"], "arch": manifest["arch"], "probes": [], "cases": [], "occupancy": []}

    def save():
        result["cubins"] = {"hits": store.hits, "misses": store.misses}
        (outdir / "gpu_check.json").write_text(json.dumps(result, indent=1))

    for probe in manifest["probes"]:
        result["probes"].append(_run_probe(bundle, probe))
        print("probe", json.dumps(result["probes"][-1]), flush=True)
        save()
    result["occupancy"] = _occupancy(bundle, manifest)
    save()
    zoo_cache = _Zoo()
    wanted = [c for c in manifest["cases"] if not args.cases or any(s in c["id"] for s in args.cases)]
    for case in wanted:
        if deadline.left() < 20:
            result["cases"].append({"id": case["id"], "skipped": "out of time"})
            continue
        t = time.monotonic()
        try:
            r = _run_case(bundle, case, zoo_cache, deadline, args)
        except Exception as err:  # one broken case must not lose the others' results
            r = {"id": case["id"], "error": f"{type(err).__name__}: {str(err)[:1500]}"}
        r["seconds"] = round(time.monotonic() - t, 1)
        result["cases"].append(r)
        print("case", json.dumps({k: v for k, v in r.items() if k not in ("kernel_names", "kernel_ms")}), flush=True)
        save()
        torch.cuda.empty_cache()
    if args.ncu:
        _ncu_all(bundle, wanted, result, deadline, args, save)
    save()
    _print_table(result)
    return 0


# -- DRAM bytes from Nsight Compute ----------------------------------------------------------------
NCU_METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum")
_UNITS = {"byte": 1, "kbyte": 1e3, "mbyte": 1e6, "gbyte": 1e9, "tbyte": 1e12}


def parse_ncu_csv(text: str) -> dict:
    """Per-kernel and total DRAM bytes from ``ncu --csv --metrics ...`` output (lines that are
    not CSV rows, such as ``==PROF==`` notes and the program's own output, are skipped)."""
    import csv

    rows = list(csv.reader(line for line in text.splitlines() if line.startswith('"')))
    if not rows:
        return {"error": "ncu printed no metrics"}
    head, body = rows[0], rows[1:]
    col = {name: i for i, name in enumerate(head)}
    per_kernel: dict[str, float] = {}
    totals = {m: 0.0 for m in NCU_METRICS}
    launches = set()
    for row in body:
        metric = row[col["Metric Name"]]
        if metric not in totals:
            continue
        value = float(row[col["Metric Value"]].replace(",", "")) * _UNITS.get(row[col["Metric Unit"]].lower(), 1)
        totals[metric] += value
        name = row[col["Kernel Name"]]
        per_kernel[name] = per_kernel.get(name, 0.0) + value
        launches.add(row[col["ID"]])
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:15]
    return {"dram_read_bytes": int(totals[NCU_METRICS[0]]), "dram_write_bytes": int(totals[NCU_METRICS[1]]),
            "kernels_profiled": len(launches), "dram_bytes_by_kernel": {k: int(v) for k, v in top}}


def _ncu_all(bundle: Path, cases: list[dict], result: dict, deadline: Deadline, args, save) -> None:
    """One inference per full-size case under ``ncu`` (in a child process, with a timeout):
    DRAM bytes read and written, per kernel and in total. Cases with more launches than
    ``--ncu-max-launches`` are skipped (ncu replays every kernel)."""
    import shutil

    ncu = shutil.which("ncu") or next((p for p in ("/usr/local/cuda/bin/ncu",) if Path(p).exists()), None)
    if ncu is None:
        result["ncu"] = "ncu not found"
        return
    by_id = {r["id"]: r for r in result["cases"]}
    for case in cases:
        r = by_id.get(case["id"])
        if r is None or "error" in r or case["size"] != "full" or case["report"]["launches"] > args.ncu_max_launches:
            continue
        if deadline.left() < 40:
            r["ncu"] = {"skipped": "out of time"}
            continue
        cmd = [ncu, "--csv", "--metrics", ",".join(NCU_METRICS), *SELF, "once",
               "--bundle", str(bundle), "--case", case["id"]]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=min(90, deadline.left() - 10),
                                  env=child_env())
            r["ncu"] = parse_ncu_csv(proc.stdout)
            if "error" in r["ncu"]:
                r["ncu"]["stderr"] = (proc.stderr or proc.stdout)[-600:]
        except subprocess.TimeoutExpired:
            r["ncu"] = {"error": "timed out"}
        print("ncu", case["id"], json.dumps({k: v for k, v in r["ncu"].items() if k != "dram_bytes_by_kernel"}),
              flush=True)
        save()


def _load_bundle(path: str) -> tuple[Path, dict]:
    """(child processes) The bundle's manifest, with TVM's runtime loaded and its cubins registered."""
    bundle = Path(path)
    manifest = json.loads((bundle / "manifest.json").read_text())
    standalone.load_runtime(bundle / "runtime", cuda=True)
    standalone.CubinStore(bundle / "cubins", manifest["arch"]).register()
    return bundle, manifest


def _device_args(specs, feeds: dict, params: list, torch, tvm_ffi) -> list:
    """The model's inputs (in order) then its weights, on the GPU, as the VM takes them."""
    return [tvm_ffi.from_dlpack(torch.from_numpy(np.array(feeds[s.name], order="C")).to("cuda"))
            for s in specs] + [tvm_ffi.from_dlpack(p) for p in params]


def once_main(args) -> int:
    """(child of ``run --ncu``) One inference of one case, nothing else on the GPU."""
    import torch
    import tvm_ffi

    bundle, manifest = _load_bundle(args.bundle)
    case = next(c for c in manifest["cases"] if c["id"] == args.case)
    vm = standalone.VM(bundle / case["lib"], "cuda")
    params, _ = _params(bundle, case, _Zoo(), torch)
    specs = [SimpleNamespace(**i) for i in case["inputs"]]
    vm(*_device_args(specs, numerics.random_inputs(specs, seed=0), params, torch, tvm_ffi))
    torch.cuda.synchronize()
    return 0


def _run_probe(bundle: Path, probe: dict, timeout: float = 90) -> dict:
    """Run one probe in a child process: a hung grid sync costs its timeout, not the lease."""
    cmd = [*SELF, "probe", "--bundle", str(bundle), "--name", probe["name"]]
    t = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=child_env())
    except subprocess.TimeoutExpired:
        return {"name": probe["name"], "kind": probe["kind"], "outcome": f"HANG (killed after {timeout:.0f} s)"}
    line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("{")), None)
    r = json.loads(line) if line else {"outcome": "crashed", "stderr": proc.stderr[-1500:]}
    r.update(name=probe["name"], kind=probe["kind"], grid=probe["grid"], block=probe["block"],
             rc=proc.returncode, seconds=round(time.monotonic() - t, 1))
    return r


def probe_main(args) -> int:
    import torch
    import tvm_ffi

    bundle, manifest = _load_bundle(args.bundle)
    probe = next(p for p in manifest["probes"] if p["name"] == args.name)
    f = tvm_ffi.load_module(str(bundle / probe["lib"]))[probe["func"]]
    n, shift = probe["n"], probe["shift"]
    g = torch.Generator(device="cuda").manual_seed(1)
    a = torch.randn(n, device="cuda", generator=g)
    b = torch.full((n,), float("nan"), device="cuda")
    c = torch.full((n,), float("nan"), device="cuda")
    try:
        f(*(tvm_ffi.from_dlpack(x) for x in (a, b, c)))
        torch.cuda.synchronize()
    except Exception as err:
        print(json.dumps({"outcome": "refused", "error": str(err).splitlines()[0][:300]}))
        return 0
    want = (torch.roll(a, -shift) + 1) * 2
    bad = int((~torch.isclose(c, want)).sum())
    print(json.dumps({"outcome": "ran", "wrong_elements": bad, "elements": n}))
    return 0


def _occupancy(bundle: Path, manifest: dict) -> list[dict]:
    """cudaOccupancyMaxActiveBlocksPerMultiprocessor for each cooperative kernel, vs our table."""
    try:
        import cupy
    except ImportError as err:
        return [{"error": f"cupy unavailable: {err}"}]
    rows = []
    kernels = [(p["cubin"], p["kernel"], p["block"], p.get("registers"), p["predicted_blocks_per_sm"])
               for p in manifest["probes"][:1]]
    for case in manifest["cases"]:
        if case["size"] != "full" or case["fusion"] != "souffle":
            continue
        for k in case["report"]["kernels"]:
            if k["cooperative"] and k.get("cubin"):
                kernels.append((k["cubin"], k["name"], k["block"][0] * k["block"][1] * k["block"][2],
                                k["registers"], k["predicted_blocks_per_sm"]))
    for cubin, name, threads, regs, predicted in kernels:
        try:
            mod = cupy.cuda.function.Module()
            mod.load(bytes((bundle / "cubins" / cubin).read_bytes()))
            fn = mod.get_function(name)
            got = cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.ptr, threads, 0)
            rows.append({"kernel": name, "threads": threads, "registers": regs, "predicted": predicted,
                         "cuda": int(got), "match": int(got) == predicted})
        except Exception as err:
            rows.append({"kernel": name, "error": str(err)[:300]})
    return rows


def _params(bundle: Path, case: dict, zoo_cache: _Zoo, torch):
    """The case's weights on the GPU, and whether every one is the real (seeded) value."""
    npz = np.load(bundle / case["params_npz"]) if case.get("params_npz") else None
    real = True
    out = []
    gen = torch.Generator(device="cuda").manual_seed(7)
    for spec in case["params"]:
        dtype = getattr(torch, spec["dtype"]) if spec["dtype"] != "bool" else torch.bool
        if spec["src"] == "npz":
            arr = npz[spec["key"]]
        elif spec["src"] == "onnx":
            arr = zoo_cache.weight(case, spec["name"])
            if _digest(arr) != spec["digest"]:
                raise RuntimeError(f"regenerated weight {spec['name']} differs from the build machine's")
        else:
            real = False
            if dtype.is_floating_point:
                out.append((torch.randn(spec["shape"], device="cuda", generator=gen) * 0.05).to(dtype))
            else:
                out.append(torch.zeros(spec["shape"], device="cuda", dtype=dtype))
            continue
        out.append(torch.from_numpy(np.array(arr, order="C")).to("cuda"))   # ascontiguousarray makes 0-d arrays 1-d
    return out, real


class _Zoo:
    """The zoo's ONNX models regenerated from their seeds on the device: one (full-size models
    are big) with its initializers, and one onnxruntime reference per model for both fusions."""

    def __init__(self):
        self.key, self.model, self.weights = None, None, {}
        self.references: dict = {}

    def _load(self, case: dict) -> None:
        key = (case["model"], case["size"], case["dtype"])
        if key != self.key:
            from onnx import numpy_helper

            self.model = zoo.build(case["model"], small=case["size"] == "small", dtype=case["dtype"])
            self.weights = {i.name: numpy_helper.to_array(i) for i in self.model.graph.initializer}
            self.key = key

    def weight(self, case: dict, name: str) -> np.ndarray:
        self._load(case)
        return self.weights[name]

    def reference(self, case: dict, feeds: dict) -> tuple[list, str]:
        key = (case["model"], case["size"], case["dtype"])
        if key not in self.references:
            self._load(case)
            t = time.monotonic()
            name, outs = numerics.reference_outputs(self.model, feeds)
            self.references[key] = (outs, f"{name} (device CPU, {time.monotonic() - t:.1f} s)")
        return self.references[key]


def _run_case(bundle: Path, case: dict, zoo_cache: _Zoo, deadline: Deadline, args) -> dict:
    import torch
    import tvm_ffi

    r = {"id": case["id"], "model": case["model"], "size": case["size"], "fusion": case["fusion"],
         "variant": case.get("variant", case["fusion"]), "dtype": case["dtype"],
         "launches_compiled": case["report"]["launches"], "grid_syncs": case["report"]["grid_syncs"]}
    vm = standalone.VM(bundle / case["lib"], "cuda")
    params, real = _params(bundle, case, zoo_cache, torch)
    specs = [SimpleNamespace(**i) for i in case["inputs"]]
    if case.get("io_npz"):
        io = np.load(bundle / case["io_npz"])
        feeds = {s.name: io[f"in_{s.name}"] for s in specs}
        ref = [io[f"ref_{i}"] for i in range(len(case["outputs"]))]
        r["reference"] = "onnxruntime (build machine)"
    else:
        feeds = numerics.random_inputs(specs, seed=0)
        ref = None
        if real and not args.no_full_reference:
            ref, r["reference"] = zoo_cache.reference(case, feeds)
        else:
            r["reference"] = None if real else "none: some weights are random stand-ins (too large to carry)"
    args_gpu = _device_args(specs, feeds, params, torch, tvm_ffi)

    def once():
        return vm(*args_gpu)

    outs = once()
    torch.cuda.synchronize()
    # Poison: the first run's outputs go back to the pool as NaN, so the checked run's outputs
    # (which the pooled allocator hands out again) start as NaN, not as a previous answer.
    for o in outs:
        t = torch.from_dlpack(o)
        if t.dtype.is_floating_point:
            t.fill_(float("nan"))
    del outs
    outs = [torch.from_dlpack(o).float().cpu().numpy() for o in once()]
    torch.cuda.synchronize()
    r["finite"] = bool(all(np.isfinite(o).all() for o in outs))
    # a race shows as run-to-run differences on the same inputs
    again = [torch.from_dlpack(o).float().cpu().numpy() for o in once()]
    r["run_to_run_max_abs"] = float(max(np.max(np.abs(a - b)) if a.size else 0.0 for a, b in zip(outs, again)))
    if ref is not None:
        cmp = numerics.compare(case["outputs"], outs, ref)
        r["rel_l2"] = max(c.rel_l2 for c in cmp)
        tol = 1e-2 if case["dtype"] == "float16" else 1e-4
        r["numerics_ok"] = bool(all(c.ok(tol) for c in cmp))
    if deadline.left() < 15:
        r["timing"] = "skipped: out of time"
        return r
    r.update(_time(once, torch, tvm_ffi, args))
    r.update(_trace(once, torch, getattr(args, "trace_reps", 1)))
    return r


def _time(once, torch, tvm_ffi, args) -> dict:
    for _ in range(3):
        once()
    torch.cuda.synchronize()
    t = time.perf_counter()
    once()
    torch.cuda.synchronize()
    est = time.perf_counter() - t
    reps = int(min(args.reps, max(5, 1.5 / max(est, 1e-6))))
    out = {"reps": reps}
    out["median_ms"], out["min_ms"] = _events(once, reps, torch)
    try:
        g = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        with tvm_ffi.use_torch_stream(torch.cuda.stream(stream)):
            for _ in range(2):
                once()
        torch.cuda.synchronize()
        with tvm_ffi.use_torch_stream(torch.cuda.graph(g)):
            keep = once()
        torch.cuda.synchronize()
        g.replay()
        torch.cuda.synchronize()
        out["graph_median_ms"], out["graph_min_ms"] = _events(g.replay, reps, torch)
        del keep
    except Exception as err:
        out["graph_error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}"
    return out


def _events(fn, reps: int, torch) -> tuple[float, float]:
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        times.append((a, b))
    torch.cuda.synchronize()
    ms = sorted(a.elapsed_time(b) for a, b in times)
    return round(float(np.median(ms)), 4), round(ms[0], 4)


def _trace(once, torch, reps: int = 1) -> dict:
    """One inference's kernels from the profiler's trace; with ``reps`` > 1 (``microbench.py``)
    that many inferences are traced: ``kernel_names`` and ``kernel_ms`` then sum over all of them
    (their ratio, what ``record`` takes, is the mean per launch), ``kernels_traced`` and
    ``kernel_busy_ms`` are per inference."""
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                once()
            torch.cuda.synchronize()
        events = [e for e in prof.events() if e.device_type.name == "CUDA"
                  and not e.name.lower().startswith(("memcpy", "memset"))]
        names = [e.name for e in events]
        from collections import Counter, defaultdict

        busy = defaultdict(float)       # microseconds on the GPU per kernel name (one inference)
        for e in events:
            busy[e.name] += float(e.time_range.elapsed_us())
        top = sorted(busy.items(), key=lambda kv: -kv[1])
        return {"kernels_traced": len(names) // reps, "distinct_traced": len(set(names)),
                "kernel_busy_ms": round(sum(busy.values()) / 1e3 / reps, 4),
                **({"trace_reps": reps} if reps > 1 else {}),
                "kernel_names": dict(Counter(names).most_common()),
                "kernel_ms": {k: round(v / 1e3, 4) for k, v in top}}
    except Exception as err:
        return {"trace_error": str(err)[:300]}


def _print_table(result: dict) -> None:
    print(f"\n{result['gpu']} ({result['sms']} SMs), {result['date']}")
    for p in result["probes"]:
        print(f"probe {p['kind']:<10} grid {p.get('grid')}x{p.get('block')}: {p.get('outcome')} "
              f"{p.get('wrong_elements', '')} {p.get('error', '')[:80]}")
    occ = [o for o in result["occupancy"] if "cuda" in o]
    if occ:
        print(f"occupancy: {sum(o['match'] for o in occ)}/{len(occ)} kernels match cudaOccupancy...")
    print(f"{'case':<30}{'launch':>7}{'trace':>7}{'rel_l2':>10}{'ms':>10}{'graph ms':>10}{'busy ms':>10}")
    for c in result["cases"]:
        if "error" in c or "skipped" in c:
            print(f"{c['id']:<30} {c.get('error', c.get('skipped'))[:100]}")
            continue
        rel = f"{c['rel_l2']:.1e}" if "rel_l2" in c else ("finite" if c.get("finite") else "NaN!")
        print(f"{c['id']:<30}{c['launches_compiled']:>7}{c.get('kernels_traced', '-'):>7}{rel:>10}"
              f"{c.get('median_ms', '-'):>10}{c.get('graph_median_ms', '-'):>10}{c.get('kernel_busy_ms', '-'):>10}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="build the bundle (needs TVM and nvcc; no GPU)")
    p.add_argument("--bundle", default=str(ROOT / "gpu_bundle"))
    p.add_argument("--models", nargs="*", default=zoo.names())
    p.add_argument("--sizes", nargs="*", default=["small", "full"], choices=["small", "full"])
    p.add_argument("--fusions", nargs="*", default=["tvm", "tvm-graph", "souffle-time", "souffle"], choices=VARIANTS,
                   help="souffle = level v3 (stitched, budget partitioner); souffle-time = v3 with the "
                        "time-driven partitioner; tvm-graph = TVM's CUDA-graph rewriting; "
                        "souffle-v4 = v3 + L2 prefetch; souffle-v0..v2 = the ablation levels")
    p.add_argument("--ablation-sizes", nargs="*", default=["full"], choices=["small", "full"],
                   help="sizes at which souffle-v0..v2 are built")
    p.add_argument("--fp32", nargs="*", default=[], help="models also built in float32 (bert, swin: paper fp16)")
    p.add_argument("--add", action="store_true", help="keep the bundle's other cases")
    p.add_argument("--no-wheel", action="store_true", help="do not download the cp312 apache-tvm-ffi wheel")
    p.add_argument("--carry-mib", type=float, default=40.0,
                   help="full-size weights changed by the compiler, carried up to this much (else random)")
    r = sub.add_parser("run", help="run the bundle on a GPU (needs torch and tvm_ffi; no TVM)")
    r.add_argument("--bundle", default=str(ROOT / "gpu_bundle"))
    r.add_argument("--out", default=os.environ.get("OUT"))
    r.add_argument("--cases", nargs="*", help="substrings of case ids to run (default: all)")
    r.add_argument("--reps", type=int, default=100)
    r.add_argument("--budget", type=float, default=400.0, help="seconds; later cases are skipped past it")
    r.add_argument("--no-full-reference", action="store_true", help="skip onnxruntime on full-size models")
    r.add_argument("--ncu", action="store_true", help="also DRAM bytes per full-size case from Nsight Compute")
    r.add_argument("--ncu-max-launches", type=int, default=200, help="skip cases with more launches under ncu")
    w = sub.add_parser("record", help="per-kernel GPU times of a run into the measured-times database")
    w.add_argument("--bundle", default=str(ROOT / "gpu_bundle"), help="the bundle the run ran (its manifest)")
    w.add_argument("--result", required=True, help="the run's gpu_check.json")
    w.add_argument("--db", default=None, help="database file (default the package data souffle_tvm/cost/data/measured.json)")
    o = sub.add_parser("once", help="(internal) one inference of one case, for ncu")
    o.add_argument("--bundle", required=True)
    o.add_argument("--case", required=True)
    q = sub.add_parser("probe", help="(internal) run one cooperative-launch probe")
    q.add_argument("--bundle", required=True)
    q.add_argument("--name", required=True)
    t = sub.add_parser("tests", help="run the gpu-marked tests (tests/test_gpu.py) against the bundle (needs pytest)")
    t.add_argument("--bundle", default=str(ROOT / "gpu_bundle"))
    args = ap.parse_args(argv)
    return {"prepare": prepare, "run": run, "probe": probe_main, "once": once_main, "record": record,
            "tests": tests_main}[args.cmd](args)


def tests_main(args) -> int:
    """pytest -m gpu on tests/test_gpu.py with the bundle (the device: no TVM; the tests need none)."""
    import importlib.util

    if importlib.util.find_spec("pytest") is None:
        print("pytest is not installed here: install it (prepare puts its wheels in the bundle's wheels/)")
        return 2
    # tests/test_gpu.py imports this module: the child finds it as this process did (child_env)
    env = {**child_env(), "SOUFFLE_GPU_BUNDLE": str(Path(args.bundle).resolve())}
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", str(ROOT / "tests" / "test_gpu.py")]
    return subprocess.run(cmd, cwd=ROOT, env=env).returncode


def record(args) -> int:
    """Each traced kernel's GPU time per launch (its busy time over its launches in one inference)
    under its database key, for kernels the manifest keyed; the partitioner then prefers it."""
    from souffle_tvm.cost.measured import MeasuredTimes

    manifest = json.loads((Path(args.bundle) / "manifest.json").read_text())
    result = json.loads(Path(args.result).read_text())
    cases = {c["id"]: c for c in manifest["cases"]}
    db = MeasuredTimes.load(args.db)
    added = 0
    for run_case in result.get("cases", []):
        case = cases.get(run_case["id"])
        busy, counts = run_case.get("kernel_ms") or {}, run_case.get("kernel_names") or {}
        if case is None:
            continue
        for k in case["report"]["kernels"]:
            if k.get("key") and k["name"] in busy and counts.get(k["name"]):
                db.add(k["key"], busy[k["name"]] * 1e3 / counts[k["name"]], gpu=result.get("gpu"),
                       date=result.get("date"), source=f"{run_case['id']} {k['name']}",
                       **{f: k[f] for f in ("form", "predicted_us", "inputs") if k.get(f) is not None})
                added += 1
    path = db.save(args.db)
    print(f"{added} kernel times recorded in {path} ({len(db.entries)} in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
