"""Per-kernel microbenchmarks for the next lent GPU (issue 32, item 3).

Single-operator ONNX models (seeded weights) at three sizes each, chosen so that the schedule
rules pick each form (``codegen.schedule.form_of``), built with ``--fusion souffle`` (level v3)
and ``--fusion tvm``; plus timing probes: an otherwise empty cooperative kernel with N grid
syncs at 1-4 blocks per SM on every SM, and an empty kernel launched N times eagerly and as N
nodes of one CUDA graph (the graph-node cost). The forms a build produced are read from its
report (``report.kernels[*].form``), never assumed.

    .venv/bin/python -m souffle_experiments microbench forms     # which forms the cases produce (here)
    .venv/bin/python -m souffle_experiments microbench prepare   # = make microbench-bundle
    PYTHONPATH=python python3 -m souffle_experiments microbench run --bundle /tmp/b/microbench_bundle --out $OUT
    .venv/bin/python -m souffle_experiments gpu-check record --bundle microbench_bundle --result OUT/gpu_check.json

``prepare`` writes ``microbench_bundle/`` (+ ``.tgz``) in ``gpu_check``'s format: the device
side is ``gpu_check.run`` itself (numerics against onnxruntime, CUDA-event medians with and
without a CUDA graph, per-kernel GPU times from the profiler's trace, here over several
inferences: ``--trace-reps``), and the timing probes, kept under the manifest's
``timing_probes`` (``gpu_check.run`` runs only ``probes``). It commits the predictions before the
run: ``data/latency/microbench-predictions-<DATE>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

os.environ.setdefault("TVM_FFI_DISABLE_TORCH_C_DLPACK", "1")

from . import gpu_check  # noqa: E402 - imports no TVM
from .paths import DATA, ROOT  # noqa: E402

ARCH = gpu_check.ARCH
DATE = "2026-12-07"
PREDICTIONS = DATA / "latency" / f"microbench-predictions-{DATE}.json"
CARRY_LIMIT = gpu_check.TRAVEL_LIMIT      # what one device call carries, the working tree included
SMS = 132                      # H200; prepare takes it from cost.hardware

# The forms the CUDA rules can give a kernel (codegen.schedule.default_rules): ours at a stitched
# block size, dlight's at its own. What the builds produced is compared with this list.
RULE_FORMS = ("StitchedMatmul", "TensorCoreMatmul", "RowReduction", "SerialReduction", "ColumnReduction",
              "PartialRows", "TiledCombine", "AtomicRows", "AlignedTiles", "WindowChain", "Fallback")
DLIGHT_RULES = ("Matmul", "GEMV", "Reduction", "GeneralReduction", "Fallback")


# == the cases ====================================================================================
def _rng(seed: int = 0):
    return np.random.default_rng(seed)


def _model(nodes, inputs, outputs, inits=()):
    from onnx import helper

    g = helper.make_graph(nodes, "microbench", inputs, outputs, list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], producer_name="souffle-microbench")
    m.ir_version = 8
    return m


def _vi(name, dtype, shape):
    from onnx import TensorProto, helper

    return helper.make_tensor_value_info(name, {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}[dtype],
                                         shape)


def _init(name, arr):
    from onnx import numpy_helper

    return numpy_helper.from_array(arr, name)


def matmul(m: int, k: int, n: int, dtype: str = "float32"):
    from onnx import helper

    w = (_rng().standard_normal((k, n)) / math.sqrt(k)).astype(dtype)
    return _model([helper.make_node("MatMul", ["X", "W"], ["Y"])], [_vi("X", dtype, [m, k])],
                  [_vi("Y", dtype, [m, n])], [_init("W", w)])


def softmax(r: int, c: int, dtype: str = "float32"):
    from onnx import helper

    return _model([helper.make_node("Softmax", ["X"], ["Y"], axis=-1)], [_vi("X", dtype, [r, c])],
                  [_vi("Y", dtype, [r, c])])


def layernorm(r: int, c: int, dtype: str = "float32"):
    from onnx import helper

    g, b = (1 + 0.1 * _rng(1).standard_normal(c)).astype(dtype), (0.1 * _rng(2).standard_normal(c)).astype(dtype)
    return _model([helper.make_node("LayerNormalization", ["X", "G", "B"], ["Y"], axis=-1, epsilon=1e-5)],
                  [_vi("X", dtype, [r, c])], [_vi("Y", dtype, [r, c])], [_init("G", g), _init("B", b)])


def conv(n: int, c: int, hw: int, group: int, dtype: str = "float32"):
    """3x3 convolution, stride 1, pad 1, ``c`` channels in and out in ``group`` groups."""
    from onnx import helper

    w = (_rng().standard_normal((c, c // group, 3, 3)) * 0.2).astype(dtype)
    return _model([helper.make_node("Conv", ["X", "W"], ["Y"], group=group, kernel_shape=[3, 3], pads=[1, 1, 1, 1])],
                  [_vi("X", dtype, [n, c, hw, hw])], [_vi("Y", dtype, [n, c, hw, hw])], [_init("W", w)])


def column_sum(r: int, c: int, dtype: str = "float32"):
    from onnx import helper

    return _model([helper.make_node("ReduceSum", ["X", "axes"], ["Y"], keepdims=0)], [_vi("X", dtype, [r, c])],
                  [_vi("Y", dtype, [c])], [_init("axes", np.array([0], dtype=np.int64))])


def gemm_then(op: str, m: int, k: int, n: int, dtype: str = "float32"):
    """MatMul followed by a row Softmax or LayerNormalization over its output rows."""
    from onnx import helper

    w = (_rng().standard_normal((k, n)) / math.sqrt(k)).astype(dtype)
    inits = [_init("W", w)]
    if op == "Softmax":
        tail = helper.make_node("Softmax", ["H"], ["Y"], axis=-1)
    else:
        inits += [_init("G", (1 + 0.1 * _rng(1).standard_normal(n)).astype(dtype)),
                  _init("B", (0.1 * _rng(2).standard_normal(n)).astype(dtype))]
        tail = helper.make_node("LayerNormalization", ["H", "G", "B"], ["Y"], axis=-1, epsilon=1e-5)
    return _model([helper.make_node("MatMul", ["X", "W"], ["H"]), tail], [_vi("X", dtype, [m, k])],
                  [_vi("Y", dtype, [m, n])], inits)


def lstm_layer(hidden: int, steps: int, dtype: str = "float32"):
    """One LSTM layer at batch 1 (the zoo's, ``hidden`` wide): its recurrent GEMV and the cell
    update cut into the GEMV's blocks (``AlignedTiles``), one grid sync a step."""
    from souffle_tvm.zoo import lstm

    return lstm.build(lstm.LSTMConfig(layers=1, steps=steps, hidden=hidden, features=hidden, batch=1), dtype)


def mbconv_chain(c: int, mid: int, hw: int, k: int, stride: int, dtype: str = "float32"):
    """MBConv's expansion and depthwise convolution, each with SiLU: one window chain
    (``WindowChain``) where the latency model predicts it faster than the two kernels."""
    from onnx import helper

    w1 = (_rng().standard_normal((mid, c, 1, 1)) / math.sqrt(c)).astype(dtype)
    w2 = (_rng(1).standard_normal((mid, 1, k, k)) / k).astype(dtype)
    b1, b2 = (_rng(2).standard_normal(mid) / 10).astype(dtype), (_rng(3).standard_normal(mid) / 10).astype(dtype)
    out = (hw + 2 * (k // 2) - k) // stride + 1
    # each convolution with its batch norm folded into a bias, as the exported EfficientNet has it
    nodes = [helper.make_node("Conv", ["X", "W1", "B1"], ["E"]), helper.make_node("Sigmoid", ["E"], ["Es"]),
             helper.make_node("Mul", ["E", "Es"], ["A"]),
             helper.make_node("Conv", ["A", "W2", "B2"], ["D"], group=mid, kernel_shape=[k, k],
                              strides=[stride, stride], pads=[k // 2] * 4),
             helper.make_node("Sigmoid", ["D"], ["Ds"]), helper.make_node("Mul", ["D", "Ds"], ["Y"])]
    return _model(nodes, [_vi("X", dtype, [1, c, hw, hw])], [_vi("Y", dtype, [1, mid, out, out])],
                  [_init("W1", w1), _init("B1", b1), _init("W2", w2), _init("B2", b2)])


def elementwise(r: int, c: int, dtype: str = "float32"):
    """x * sigmoid(x) + 1: one elementwise kernel."""
    from onnx import helper

    one = np.ones((1,), dtype=dtype)
    return _model([helper.make_node("Sigmoid", ["X"], ["S"]), helper.make_node("Mul", ["X", "S"], ["M"]),
                   helper.make_node("Add", ["M", "one"], ["Y"])],
                  [_vi("X", dtype, [r, c])], [_vi("Y", dtype, [r, c])], [_init("one", one)])


@dataclass
class Case:
    id: str
    op: str                      # the operator family (the manifest's "model")
    size: str                    # s, m, l
    fusion: str                  # souffle (level v3) or tvm
    build: Callable              # () -> ONNX ModelProto
    aim: str                     # the form the case is meant to produce (what the build gives is recorded)
    dtype: str = "float32"
    options: dict = field(default_factory=dict)    # compile options (gemm_tile, level)

    @property
    def level(self) -> str | None:
        return self.options.get("level") if self.fusion == "souffle" else None


SIZES = ("s", "m", "l")
# op: (aim, builder, three argument tuples, dtype, souffle option variants {suffix: options})
FAMILIES = {
    "matmul-fp32": ("StitchedMatmul", matmul, [(64, 256, 256), (256, 512, 512), (1024, 1024, 1024)], "float32",
                    {"t16": {"gemm_tile": 16}, "t32": {"gemm_tile": 32}, "t64": {"gemm_tile": 64}, "auto": {}}),
    # few output tiles, long K: the time partitioner's block size choice gives these 512 threads
    "matmul-fp32-few": ("StitchedMatmul@512", matmul, [(16, 4096, 32), (32, 8192, 64), (64, 8192, 128)], "float32",
                        {"time": {"partitioner": "time"}}),
    # few tiles, a long K: the K tile the rule chooses (auto) against each fixed one; the shapes
    # of EfficientNet-B0's 7 x 7 and ResNeXt's 14 x 14 1x1 convolutions (pixels x K x channels)
    "matmul-fp32-longk": ("StitchedMatmul/k64", matmul, [(49, 1152, 192), (49, 1152, 320), (196, 1024, 512)],
                          "float32", {"k16": {"gemm_k_tile": 16}, "k32": {"gemm_k_tile": 32},
                                      "k64": {"gemm_k_tile": 64}, "auto": {}}),
    "matmul-fp16": ("TensorCoreMatmul", matmul, [(64, 256, 256), (256, 512, 512), (1024, 1024, 1024)], "float16",
                    {"": {}}),
    "softmax": ("RowReduction", softmax, [(128, 128), (1024, 512), (4096, 1024)], "float32", {"": {}}),
    "softmax-long": ("RowReduction@512", softmax, [(8, 16384), (16, 32768), (32, 32768)], "float32",
                     {"time": {"partitioner": "time"}}),
    "layernorm": ("RowReduction", layernorm, [(128, 128), (1024, 768), (4096, 1024)], "float32", {"": {}}),
    "dwconv": ("SerialReduction", lambda n, c, hw, dtype: conv(n, c, hw, c, dtype), [(1, 32, 14), (1, 96, 28), (1, 192, 56)],
               "float32", {"": {}}),
    "gconv": ("SerialReduction", lambda n, c, hw, dtype: conv(n, c, hw, c // 8, dtype),
              [(1, 32, 14), (1, 64, 28), (1, 128, 28)],
              "float32", {"": {}}),
    "colsum": ("ColumnReduction", column_sum, [(256, 64), (2048, 512), (8192, 1024)], "float32", {"": {}}),
    "colsum-tall": ("ColumnReduction@512", column_sum, [(16384, 64), (65536, 64), (65536, 128)], "float32",
                    {"time": {"partitioner": "time"}}),
    "matmul-softmax": ("PartialRows/TiledCombine/AtomicRows", lambda m, k, n, dtype: gemm_then("Softmax", m, k, n, dtype),
                       [(64, 256, 256), (256, 512, 512), (1024, 512, 1024)], "float32", {"": {}}),
    "matmul-layernorm": ("PartialRows/TiledCombine/AtomicRows", lambda m, k, n, dtype: gemm_then("LN", m, k, n, dtype),
                         [(64, 256, 256), (256, 512, 768), (1024, 512, 1024)], "float32",
                         {"": {}, "atomic": {"reduction": "atomic"}}),
    "elementwise": ("Fallback", elementwise, [(128, 128), (1024, 1024), (4096, 4096)], "float32", {"": {}}),
    "lstm-layer": ("AlignedTiles/ColumnReduction", lstm_layer, [(64, 8), (256, 8), (256, 32)], "float32",
                   {"": {}, "auto": {"level": "auto"}}),
    # EfficientNet-B0's expansions and depthwise convolutions (channels in, expanded, side, k, stride)
    "mbconv": ("WindowChain", mbconv_chain, [(24, 144, 28, 5, 1), (16, 96, 112, 3, 2), (24, 144, 56, 3, 1)],
               "float32", {"": {}, "auto": {"level": "auto"}}),
}


def cases(families=None, sizes=SIZES, fusions=("souffle", "tvm")) -> list[Case]:
    """Every family at each size: the souffle build (level v3) in each option variant, and TVM's
    own kernels (``--fusion tvm``, dlight's rules) once."""
    out = []
    for op, (aim, builder, shapes, dtype, variants) in FAMILIES.items():
        if families and op not in families:
            continue
        for size, shape in zip(SIZES, shapes):
            if size not in sizes:
                continue
            make = functools.partial(builder, *shape, dtype=dtype)
            if "souffle" in fusions:
                for suffix, opts in variants.items():
                    out.append(Case(f"mb-{op}-{size}-souffle{'-' + suffix if suffix else ''}", op, size, "souffle",
                                    make, aim, dtype, {"level": "v3", **opts}))
            if "tvm" in fusions:
                out.append(Case(f"mb-{op}-{size}-tvm", op, size, "tvm", make, "dlight", dtype))
    return out


def compile_case(case: Case):
    from souffle_tvm.pipeline.driver import compile as compile_model

    opts = dict(case.options)
    level = opts.pop("level", None) or "v2"
    return compile_model(case.build(), "cuda", case.fusion, arch=ARCH, level=level, **opts)


def kernel_rows(report) -> list[dict]:
    """Each distinct kernel's form and the latency model's figures, as the report gives them."""
    seen, rows = set(), []
    for k in report.kernels:
        if k.name in seen:
            continue
        seen.add(k.name)
        rows.append({"name": k.name, "form": k.form, "grid": k.grid, "block": k.block, "launches": k.launches,
                     "cooperative": k.cooperative, "grid_syncs": k.grid_syncs, "predicted_us": k.predicted_us,
                     "floor_us": k.floor_us, "floor_by": k.floor_by})
    return rows


def rule_forms(forms) -> dict:
    """Which of the rules' forms the builds produced (a stitched kernel's stages split at "+")."""
    seen = {f.strip() for form in forms if form for f in form.split("+")}
    ours = {r: sorted(f for f in seen if f.split("@")[0] == r) for r in RULE_FORMS}
    dlight = sorted(f for f in seen if f.startswith("dlight"))
    sizes = [f"{r}@{b}" for r in RULE_FORMS for b in (128, 256, 512) if f"{r}@{b}" not in seen]
    return {"seen": sorted(seen), "rules": ours, "missing": [r for r, fs in ours.items() if not fs],
            "missing_block_sizes": sizes, "dlight": dlight}


def forms_main(args) -> int:
    rows = []
    for case in cases(args.families, args.sizes, args.fusions):
        t = time.perf_counter()
        try:
            c = compile_case(case)
        except Exception as err:       # noqa: BLE001 - a survey: say which case fails
            print(f"{case.id:<40} FAILED {type(err).__name__}: {str(err)[:200]}", flush=True)
            continue
        ks = kernel_rows(c.report)
        rows += ks
        print(f"{case.id:<40} {time.perf_counter() - t:5.1f}s {c.report.latency.get('ms')} ms  "
              + "; ".join(f"{k['form']} {k['grid']}x{k['block']} {k['predicted_us']}us" for k in ks), flush=True)
    print(json.dumps(rule_forms(k["form"] for k in rows), indent=1))
    return 0



# == prepare (build machine) ======================================================================
# Timing probes: grid syncs per cooperative kernel, blocks per SM on every SM, threads per block;
# empty-kernel launches per eager batch and per graph.
SYNC_COUNTS = (1, 16, 64)
SYNC_BLOCKS_PER_SM = (1, 2, 3, 4)
PROBE_BLOCK = 256
GRAPH_NODES = (1, 100)


def prepare(args) -> int:
    import tvm

    from souffle_tvm.cost import hardware
    from souffle_tvm.runtime import numerics, standalone

    out = Path(args.out)
    if (out / "manifest.json").is_file():
        shutil.rmtree(out)     # a file of an earlier bundle is taken as this one's (_Carry.take): start clean
    (out / "libs").mkdir(parents=True, exist_ok=True)
    (out / "data").mkdir(exist_ok=True)
    store = standalone.CubinStore(out / "cubins", ARCH)
    gpu = hardware.for_arch(ARCH)
    manifest = {"arch": ARCH, "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "tvm": tvm.__version__, "microbench": DATE, "cases": [], "probes": [], "timing_probes": []}
    gpu_check._copy_runtime(out)
    if not args.no_wheel:
        gpu_check._fetch_ffi_wheel(out / "wheels")
    manifest["timing_probes"] = build_timing_probes(out, store, gpu.sms) if not args.no_probes else []
    predictions = {"date": DATE, "gpu": gpu.name if hasattr(gpu, "name") else "H200", "arch": ARCH,
                   "sms": gpu.sms, "note": "committed before the run: the latency model's figures for each "
                                          "kernel of each case (predicted_us: one launch), by kernel key",
                   "cases": [], "timing_probes": [_probe_prediction(p) for p in manifest["timing_probes"]]}
    todo = cases(args.families, args.sizes, args.fusions)
    carry = _Carry(args.file_mib * 2**20, args.carry_mib * 2**20)
    for n, case in enumerate(todo, 1):
        t = time.perf_counter()
        try:
            c = compile_case(case)
        except Exception as err:        # noqa: BLE001 - one case that does not build must not lose the rest
            print(f"[{n}/{len(todo)}] {case.id} FAILED: {type(err).__name__}: {str(err)[:300]}", flush=True)
            predictions["cases"].append({"id": case.id, "error": f"{type(err).__name__}: {str(err)[:300]}"})
            continue
        lib = out / "libs" / f"{case.id}.so"
        c.executable.export_library(str(lib))
        if c.cuda_source:
            store.add(c.cuda_source)
        # every weight travels (they are small): nothing is regenerated from the zoo on the device
        params = [{"shape": list(p.shape), "dtype": str(p.dtype), "src": "npz", "key": f"p{i:05d}"}
                  for i, p in enumerate(c.model.params)]
        entry = {"id": case.id, "model": f"mb-{case.op}", "size": case.size, "fusion": case.fusion,
                 "level": case.level, "variant": case.id.split(f"-{case.size}-", 1)[1], "dtype": case.dtype,
                 "lib": str(lib.relative_to(out)), "params": params,
                 "inputs": [{"name": i.name, "shape": list(i.shape), "dtype": i.dtype} for i in c.model.inputs],
                 "outputs": list(c.model.outputs),
                 "report": gpu_check._summary(c.report, gpu, store.path(c.cuda_source).name if c.cuda_source else None,
                                              c.model.mod)}
        # Data travels where it is small (one file at most --file-mib, all at most --carry-mib), one
        # copy per content: weights and the inputs + onnxruntime outputs that check numerics. A
        # larger case runs on seeded random inputs and stand-in weights (src "random"): timed and
        # checked finite and run-to-run, not against a reference (gpu_check.run's rule for those).
        if params:
            digest = gpu_check._digest(np.concatenate([np.ravel(a).view(np.uint8) for a in c.model.params]))
            name = f"data/params-{digest}.npz"
            if carry.take(out / name, sum(a.nbytes for a in c.model.params),
                          lambda f: np.savez(f, **{p["key"]: a for p, a in zip(params, c.model.params)})):
                entry["params_npz"] = name
            else:
                for spec in params:
                    spec["src"] = "random"
        feeds = numerics.random_inputs(c.model.inputs, seed=0)
        io_name = f"data/{case.op}-{case.size}.io.npz"       # one model per family and size
        io_bytes = sum(v.nbytes for v in feeds.values()) + _output_bytes(c)

        def write_io(f, case=case, feeds=feeds):
            _, ref = numerics.reference_outputs(case.build(), feeds)
            np.savez(f, **{f"in_{k}": v for k, v in feeds.items()}, **{f"ref_{i}": r for i, r in enumerate(ref)})

        if (not params or "params_npz" in entry) and carry.take(out / io_name, io_bytes, write_io):
            entry["io_npz"] = io_name
        rows = {k["name"]: k for k in kernel_rows(c.report)}
        for k in entry["report"]["kernels"]:       # the form and floors beside gpu_check's figures
            k.update({f: rows[k["name"]][f] for f in ("form", "floor_us", "floor_by")})
        manifest["cases"].append(entry)
        predictions["cases"].append(_case_prediction(case, entry, c.report))
        print(f"[{n}/{len(todo)}] {case.id}: {c.report.launches} launches, "
              + "; ".join(str(k["form"]) for k in entry["report"]["kernels"]) + f" ({time.perf_counter() - t:.1f} s)",
              flush=True)
        (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    tgz = gpu_check.pack(out)
    forms = rule_forms(k["form"] for c in predictions["cases"] for k in c.get("kernels", []))
    predictions["forms"] = {**forms, "not_produced_why": {**{r: "not reached by these cases" for r in forms["missing"]},
                                                          **NOT_PRODUCED}}
    tree, over = gpu_check.travel_check(tgz)
    predictions["bundle"] = {"bytes": size, "tgz_bytes": tgz.stat().st_size, "tree_bytes": tree,
                             "limit_bytes": CARRY_LIMIT,
                             "cases": len(manifest["cases"]), "timing_probes": len(manifest["timing_probes"])}
    predictions["gpu_time_estimate"] = estimate(manifest, args.reps, args.trace_reps)
    if not args.no_predictions:
        path = Path(args.predictions)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(predictions, indent=1) + "\n")
        print(f"predictions: {path}")
    print(f"bundle {out}: {size / 2**20:.1f} MiB ({tgz.stat().st_size / 2**20:.1f} MiB as {tgz.name}, "
          f"{tree / 2**20:.1f} MiB of working tree beside it; limit {CARRY_LIMIT / 2**20:.0f} MiB together), "
          f"{len(manifest['cases'])} cases, "
          f"{len(manifest['timing_probes'])} timing probes; estimated GPU time "
          f"{predictions['gpu_time_estimate']['total_s']:.0f} s of {BUDGET_S} s", flush=True)
    if over:
        print(f"ERROR: {over}", flush=True)
        return 1
    return 0


class _Carry:
    """Data files within a per-file and a total limit, each written once (same name: same content)."""

    def __init__(self, per_file: float, total: float):
        self.per_file, self.total, self.used = per_file, total, 0

    def take(self, path: Path, nbytes: int, write) -> bool:
        if path.exists():
            return True
        if nbytes > self.per_file or self.used + nbytes > self.total:
            return False
        write(path)
        self.used += path.stat().st_size
        return True


# Why a rule form is not produced, where a case could not reach it (filled from the survey).
NOT_PRODUCED = {
    "AtomicRows": "only with --reduction atomic on a two-phase row sum (the matmul-layernorm-*-atomic cases)",
    "@128": "no case got 128 threads: the budget partitioner offers 128 but its model never chose it for "
            "these shapes, and the time partitioner prices 256 and 512 only (partition.block_size.TIME_BLOCKS)",
    "PartialRows/TiledCombine/AtomicRows@512": "by design: these rules schedule at STITCH_BLOCK (256) only "
                                               "(codegen.schedule.STITCH_BLOCK_ONLY_RULES)",
    "TensorCoreMatmul/SerialReduction/Fallback@512": "the model kept 256 for every shape tried (the 512 forms "
                                                     "came from few-tile shapes under the time partitioner)",
    "dlight rules": "--fusion tvm kernels' form is 'dlight' without the rule's name (report.kernels[*].form)",
    "StitchedMatmul micro tiles at 512": "gemm_tile 16/32/64 (micro 1/2/4) cases all stayed at 256 threads",
}


def _output_bytes(c) -> int:
    """Bytes of the model's outputs (from the ONNX graph's declared shapes)."""
    from onnx import helper

    total = 0
    for o in c.model.onnx_model.graph.output:
        t = o.type.tensor_type
        dims = [d.dim_value for d in t.shape.dim]
        total += math.prod(dims) * np.dtype(helper.tensor_dtype_to_np_dtype(t.elem_type)).itemsize
    return total


def _case_prediction(case: Case, entry: dict, report) -> dict:
    return {"id": case.id, "op": case.op, "size": case.size, "fusion": case.fusion, "level": case.level,
            "options": {k: v for k, v in case.options.items() if k != "level"}, "aim": case.aim,
            "dtype": case.dtype, "launches": report.launches,
            "predicted_ms": report.latency.get("ms"), "predicted_graph_ms": report.latency.get("graph_ms"),
            "predicted_gpu_ms": report.latency.get("gpu_ms"),
            "kernels": [{f: k.get(f) for f in ("name", "key", "form", "grid", "block", "launches", "cooperative",
                                               "grid_syncs", "predicted_us", "floor_us", "floor_by", "inputs")}
                        for k in entry["report"]["kernels"]]}


def build_timing_probes(out: Path, store, sms: int) -> list[dict]:
    """Empty cooperative kernels with N grid syncs at 1-4 blocks per SM on every SM, and an empty
    (non-cooperative) kernel for the launch and graph-node costs."""
    probes = [_build_empty(out, store, f"sync{n}_bps{b}", sms * b, PROBE_BLOCK, n)
              for b in SYNC_BLOCKS_PER_SM for n in SYNC_COUNTS]
    probes.append(_build_empty(out, store, "empty", 1, 32, 0))
    return probes


def _build_empty(out: Path, store, name: str, grid: int, block: int, syncs: int) -> dict:
    """The stitched probe kernel of ``gpu_check`` (same launch, same parameters) with its stages
    replaced by ``syncs`` grid syncs (none: an empty body, launched without the cooperative flag)."""
    import tvm
    from tvm import tirx

    from souffle_tvm.build import executable as build_tvm
    from souffle_tvm.cost import hardware
    from souffle_tvm.core.targets import make_target
    from souffle_tvm.stitch import kernel_ir

    attrs = dict(make_target("cuda", ARCH).attrs)   # the stages' threads = the kernel's (as schedule_group does)
    attrs.update({"kind": "cuda", "max_num_threads": block, "max_threads_per_block": block})
    attrs.pop("keys", None)
    fname = f"mb_{name}"
    func, target, n = gpu_check.two_stage_kernel(grid, block, 1, fname, tvm.target.Target(attrs))
    sync = next(s for s in kernel_ir.stage_loops(func) if kernel_ir.is_grid_sync(s))
    if syncs:
        body = [sync] * syncs
    else:   # a body TVM cannot drop (an empty one leaves no CUDA kernel): one load, a store never taken
        a_buf, c_buf = func.params[0], func.params[-1]     # parameters are buffers (TVM 0.27)
        big = tirx.const(3e38, "float32")
        body = [tirx.IfThenElse(tirx.BufferLoad(a_buf, [0]) > big,
                                tirx.BufferStore(c_buf, tirx.BufferLoad(a_buf, [0]), [0]), None)]
    func = kernel_ir.replace_stages(func, body)
    built = gpu_check.export_probe(out, store, fname, func, target, build_tvm.TIR_PIPELINE, block)
    return {"name": name, **built, "grid": grid, "block": block, "n": n, "syncs": syncs,
            "blocks_per_sm": grid // hardware.for_arch(ARCH).sms if syncs else None,
            "cooperative": syncs > 0}


def _probe_prediction(p: dict) -> dict:
    """The latency model's constants for what a probe measures (``cost.latency.FITTED``)."""
    from souffle_tvm.cost import latency

    c = latency.FITTED
    got = {k: getattr(c, k, None) for k in ("launch_us", "node_us", "sync_us")}
    row = {f: p[f] for f in ("name", "grid", "block", "syncs", "blocks_per_sm", "cooperative")}
    if p["syncs"]:
        row["predicted_us_per_sync"] = got["sync_us"]
        row["predicted_blocks_per_sm_fit"] = p["predicted_blocks_per_sm"] >= (p["blocks_per_sm"] or 0)
    else:
        row.update(predicted_launch_us=got["launch_us"], predicted_node_us=got["node_us"])
    return row


# == the GPU time estimate ========================================================================
BUDGET_S = 300
# Fixed costs, from data/gpu runs 1-3 (gpu_check.json "seconds" per case): the first case
# ~8 s (CUDA context, torch's first kernels), each later small case ~0.1 s besides its reps.
START_S = 60.0          # untar, pip install of the wheels, python + torch import, runtime load
FIRST_CASE_S = 8.0
PER_CASE_S = 0.5        # VM load, cubin load, numerics (3 runs), graph capture, profiler set-up
HOST_CALL_MS = 0.1      # one VM call through tvm_ffi (host side) where the GPU is faster
PROBE_REPS = 200


def estimate(manifest: dict, reps: int, trace_reps: int) -> dict:
    """Seconds of GPU time for ``run``: fixed costs + per case (3 warm-up + 1 estimate + reps
    eager + reps graph replays + 2 captures + trace_reps traced + 3 checked) inferences at the
    larger of the predicted time and the host's call time + the timing probes."""
    per_case = []
    for c in manifest["cases"]:
        pred = c["report"]["predicted"] or {}
        eager = max(pred.get("ms") or 0.0, HOST_CALL_MS * c["report"]["launches"])
        graph = max(pred.get("graph_ms") or 0.0, 0.01)
        s = PER_CASE_S + ((3 + 1 + 3 + 2 + trace_reps + reps) * eager + reps * graph) / 1e3
        per_case.append(s)
    probes = 0.0
    for p in manifest.get("timing_probes", []):
        per = (max(1.2 * p["syncs"], 5.0) if p["syncs"] else 0.01 * max(GRAPH_NODES)) * 1e-6
        probes += 0.2 + PROBE_REPS * (3 + max(GRAPH_NODES)) * per
    total = START_S + FIRST_CASE_S + sum(per_case) + probes
    return {"total_s": round(total, 1), "budget_s": BUDGET_S, "start_s": START_S, "first_case_s": FIRST_CASE_S,
            "cases_s": round(sum(per_case), 1), "probes_s": round(probes, 1), "reps": reps,
            "trace_reps": trace_reps,
            "how": "START_S + FIRST_CASE_S + per case (PER_CASE_S + ((3 warm-up + 1 + 3 checked + 2 captures "
                   "+ trace_reps + reps) x max(predicted ms, 0.1 ms x launches) + reps x predicted graph ms)) "
                   "+ per probe (0.2 s + PROBE_REPS x (3 + 100 launches) x max(1.2 us x syncs, 5 us))"}


# == run (device: no TVM) =========================================================================
def run_main(args) -> int:
    """gpu_check.run on the bundle's cases (trace over --trace-reps inferences), then the timing
    probes in this process; ``$OUT/gpu_check.json`` (for ``gpu-check record``) and
    ``$OUT/microbench.json`` (the probes)."""
    bundle = Path(args.bundle)
    manifest = json.loads((bundle / "manifest.json").read_text())
    outdir = Path(args.out or ".")
    outdir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    if not args.probes_only:
        ns = argparse.Namespace(bundle=str(bundle), out=str(outdir), cases=args.cases, reps=args.reps,
                                budget=args.budget, no_full_reference=True, ncu=False, trace_reps=args.trace_reps)
        gpu_check.run(ns)
    else:
        gpu_check._load_bundle(str(bundle))
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "cases_seconds": round(time.monotonic() - t0, 1), "probes": []}
    import torch

    result["gpu"] = torch.cuda.get_device_name(0)
    for p in manifest.get("timing_probes", []):
        try:
            result["probes"].append(_time_probe(bundle, p, torch))
        except Exception as err:        # noqa: BLE001 - a refused launch is a result too
            result["probes"].append({"name": p["name"], "error": f"{type(err).__name__}: {str(err)[:300]}"})
        print("probe", json.dumps(result["probes"][-1]), flush=True)
        (outdir / "microbench.json").write_text(json.dumps(result, indent=1))
    result["fit"] = fit_probes(result["probes"])
    result["seconds"] = round(time.monotonic() - t0, 1)
    (outdir / "microbench.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result["fit"], indent=1))
    return 0


def _time_probe(bundle: Path, p: dict, torch) -> dict:
    import tvm_ffi

    f = tvm_ffi.load_module(str(bundle / p["lib"]))[p["func"]]
    bufs = [tvm_ffi.from_dlpack(torch.zeros(p["n"], device="cuda")) for _ in range(3)]

    def launch():
        f(*bufs)

    for _ in range(3):
        launch()
    torch.cuda.synchronize()
    r = {"name": p["name"], "grid": p["grid"], "block": p["block"], "syncs": p["syncs"],
         "blocks_per_sm": p["blocks_per_sm"]}
    r["us"] = _median_us(lambda: launch(), torch)            # one launch between two events
    k = max(GRAPH_NODES)
    r["batch_us"] = _median_us(lambda: [launch() for _ in range(k)], torch) / k     # back to back
    if not p["cooperative"]:
        for nodes in GRAPH_NODES:
            g = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream()
            with tvm_ffi.use_torch_stream(torch.cuda.stream(stream)):
                launch()
            torch.cuda.synchronize()
            with tvm_ffi.use_torch_stream(torch.cuda.graph(g)):
                for _ in range(nodes):
                    launch()
            torch.cuda.synchronize()
            r[f"graph{nodes}_us"] = _median_us(g.replay, torch)
    return r


def _median_us(fn, torch, reps: int = PROBE_REPS) -> float:
    pairs = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        pairs.append((a, b))
    torch.cuda.synchronize()
    return round(float(np.median([a.elapsed_time(b) for a, b in pairs])) * 1e3, 3)


def fit_probes(rows: list[dict]) -> dict:
    """Per grid sync at each blocks per SM: the slope of the batch time over the sync counts;
    launch: the empty kernel back to back; graph node: (graph of 100 - graph of 1) / 99."""
    fit = {"sync_us": {}}
    for bps in SYNC_BLOCKS_PER_SM:
        pts = sorted((r["syncs"], r["batch_us"]) for r in rows if r.get("blocks_per_sm") == bps and "batch_us" in r)
        if len(pts) >= 2:
            x, y = np.array(pts, dtype=float).T
            slope, icpt = np.polyfit(x, y, 1)
            fit["sync_us"][str(bps)] = {"per_sync": round(float(slope), 4), "intercept": round(float(icpt), 3)}
    empty = next((r for r in rows if r.get("syncs") == 0 and "batch_us" in r), None)
    if empty:
        fit["launch_us"] = empty["batch_us"]
        lo, hi = min(GRAPH_NODES), max(GRAPH_NODES)
        if f"graph{hi}_us" in empty:
            fit["node_us"] = round((empty[f"graph{hi}_us"] - empty[f"graph{lo}_us"]) / (hi - lo), 4)
    return fit


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("forms", help="compile the cases and list the forms their kernels got (no bundle)")
    f.add_argument("--families", nargs="*", choices=list(FAMILIES))
    f.add_argument("--sizes", nargs="*", default=list(SIZES), choices=SIZES)
    f.add_argument("--fusions", nargs="*", default=["souffle", "tvm"], choices=["souffle", "tvm"])
    p = sub.add_parser("prepare", help="build the bundle and the predictions (TVM and nvcc; no GPU)")
    p.add_argument("--out", default=str(ROOT / "microbench_bundle"))
    p.add_argument("--families", nargs="*", choices=list(FAMILIES))
    p.add_argument("--sizes", nargs="*", default=list(SIZES), choices=SIZES)
    p.add_argument("--fusions", nargs="*", default=["souffle", "tvm"], choices=["souffle", "tvm"])
    p.add_argument("--predictions", default=str(PREDICTIONS))
    p.add_argument("--no-predictions", action="store_true", help="do not write the predictions file")
    p.add_argument("--no-wheel", action="store_true", help="do not download the cp312 wheels")
    p.add_argument("--no-probes", action="store_true", help="no timing probes")
    p.add_argument("--file-mib", type=float, default=1.0, help="data files (weights, inputs + references) "
                   "carried up to this size each; larger cases run on stand-ins, unchecked")
    p.add_argument("--carry-mib", type=float, default=16.0, help="... and up to this much in all (the .tgz "
                   "travels with the working tree: 64 MiB together)")
    p.add_argument("--reps", type=int, default=100, help="the run's reps (for the estimate)")
    p.add_argument("--trace-reps", type=int, default=20, help="the run's traced inferences (for the estimate)")
    r = sub.add_parser("run", help="run the bundle on the GPU (torch, tvm_ffi; no TVM)")
    r.add_argument("--bundle", default=str(ROOT / "microbench_bundle"))
    r.add_argument("--out", default=os.environ.get("OUT"))
    r.add_argument("--cases", nargs="*", help="substrings of case ids (default: all)")
    r.add_argument("--reps", type=int, default=100)
    r.add_argument("--trace-reps", type=int, default=20, help="inferences traced for the per-kernel times")
    r.add_argument("--budget", type=float, default=240.0, help="seconds for the cases (gpu_check.run)")
    r.add_argument("--probes-only", action="store_true")
    args = ap.parse_args(argv)
    return {"forms": forms_main, "prepare": prepare, "run": run_main}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
