"""The model tests of ONNX's conformance suite built for CUDA at the default level, with nvcc.

    python -m souffle_experiments onnx-models-cuda                       # simple, pytorch-converted, pytorch-operator
    python -m souffle_experiments onnx-models-cuda --kinds real --only 'squeezenet|alexnet'

The model tests that ``souffle_experiments/onnx_conformance.py`` runs on llvm (the onnx package's own models:
"real" = its local light CNNs at 224x224, "simple", "pytorch-converted", "pytorch-operator";
nothing downloaded), each compiled with ``souffle_tvm.compile(model, "cuda", "souffle")`` at
the default level (auto) for sm_90 with nvcc's ptxas checking every kernel. Nothing runs (no
GPU here). Outcomes: builds; unsupported (the project's clear refusal, as on llvm); fails
(anything else). Writes a Markdown table (``--out``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import sys
import time
import warnings

from . import paths

ROOT = str(paths.ROOT)
KINDS = ("simple", "pytorch-converted", "pytorch-operator", "real")


def model_paths(kinds: list[str], only: str | None) -> dict[str, tuple[str, str]]:
    """{test name: (kind, model path)} of BackendTest's model tests of these kinds."""
    import onnx
    from onnx.backend.test.loader import load_model_tests

    out = {}
    for kind in kinds:
        for case in load_model_tests(kind=kind):
            if case.model_dir:
                path = os.path.join(case.model_dir, "model.onnx")
            else:
                path = os.path.join(os.path.dirname(os.path.dirname(onnx.__file__)), case.url)
            if not only or re.search(only, case.name):
                out[case.name] = (kind, path)
    return out


def build(path: str) -> tuple[str, str]:
    """(outcome, detail) of one model built for CUDA at the default level."""
    from souffle_tvm.pipeline.driver import compile as compile_model
    from souffle_tvm.pipeline.onnx_backend import UNSUPPORTED

    try:
        c = compile_model(path, "cuda", "souffle")
    except UNSUPPORTED as err:
        return "unsupported", f"{type(err).__name__}: {str(err).strip().splitlines()[0][:150]}"
    except Exception as err:  # noqa: BLE001 - the table records whatever went wrong
        text = (str(err).strip().splitlines() or [type(err).__name__])[-1]
        return "fails", f"{type(err).__name__}: {text[:150]}"
    r = c.report
    if not r.kernels:      # sequence ops and the like: the VM's builtins, no device code to check
        return "builds", "no device kernel (the VM's builtins only)"
    if not r.nvcc.get("available"):
        return "fails", "nvcc not found: nothing checked"
    kept = "TVM's kernels kept" if r.fallback else "Souffle's kept"
    return "builds", f"{r.launches} launches, {len(r.kernels)} kernels, {kept}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", nargs="+", default=[k for k in KINDS if k != "real"], choices=KINDS,
                    help="which model tests (real: the 224x224 CNNs, minutes each on 2 cores)")
    ap.add_argument("--only", help="regular expression on the test name (re.search)")
    ap.add_argument("--out", default=os.path.join(ROOT, "results", f"onnx-models-cuda-{datetime.date.today()}.md"))
    args = ap.parse_args(argv)
    os.environ.setdefault("ONNX_HOME", os.path.join("/tmp", "souffle-tvm-onnx-home"))
    warnings.filterwarnings("ignore")
    rows, counts = [], {}
    for name, (kind, path) in sorted(model_paths(args.kinds, args.only).items()):
        t = time.perf_counter()
        outcome, detail = build(path)
        secs = time.perf_counter() - t
        counts[outcome] = counts.get(outcome, 0) + 1
        rows.append(f"| {name} | {kind} | {outcome} | {detail.replace('|', '/')} | {secs:.1f} |")
        print(rows[-1], flush=True)
    lines = [f"# ONNX conformance model tests built for CUDA at the default level ({datetime.date.today()})", "",
             f"`python -m souffle_experiments onnx-models-cuda --kinds {' '.join(args.kinds)}`"
             + (f" `--only '{args.only}'`" if args.only else "")
             + ": each model compiled with `--fusion souffle` at the default level (auto) for sm_90, "
             "ptxas (nvcc, CUDA 13.0) checking every kernel; nothing run (no GPU). "
             + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) + ".", "",
             "| test | kind | outcome | detail | seconds |", "| --- | --- | --- | --- | --- |", *rows]
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {args.out}: {counts}")
    return 1 if counts.get("fails") else 0


if __name__ == "__main__":
    sys.exit(main())
