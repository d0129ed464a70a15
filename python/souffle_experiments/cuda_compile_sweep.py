"""Every model of ONNX's conformance suite compiled for CUDA at the default level: which compile,
which are refused with the project's clear error, which crash.

    python -m souffle_experiments sweep run OUT.jsonl [--shard I --shards N] [--only SUBSTRING] [--emulate]
    python -m souffle_experiments sweep table OUT.jsonl [BEFORE.jsonl] > results.md

``onnx_conformance.py`` runs the suite on llvm (numerics); this compiles the same models for
``cuda`` (sm_90) with ``--fusion souffle`` at the default level, which stitches, prices and builds
TVM's kernels too, without nvcc (CUDA codegen still runs; a kernel CUDA cannot hold fails there).
Models: the node tests the onnx package makes and its shipped simple, pytorch-converted and
pytorch-operator models (nothing downloaded). Outcomes: ok; refused (a ``SouffleError``: the
clear error a user gets); crash (anything else, with the deepest frame of ours). Each model
has 120 s; a run resumes where OUT.jsonl stops, so a shard killed half-way loses one model.
With ``--emulate`` each model's default-level CUDA module (our kernels as scheduled and stitched,
before TVM's build) runs in the GPU emulator against onnxruntime instead: match, mismatch (a wrong
kernel: relative L2 over 1e-3) or not emulated (the emulator or the reference cannot run it).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

KINDS = ("node", "simple", "pytorch-converted", "pytorch-operator")
LIMIT_S = 120


def models() -> dict[str, bytes]:
    """{kind:test name: serialized ModelProto} of the conformance suite, offline."""
    from onnx.backend.test.loader import load_model_tests

    out = {}
    for kind in KINDS:
        for case in load_model_tests(kind=kind):
            path = os.path.join(case.model_dir or "", "model.onnx")
            if case.model is not None:
                out[f"{kind}:{case.name}"] = case.model.SerializeToString()
            elif case.model_dir and os.path.exists(path):
                out[f"{kind}:{case.name}"] = Path(path).read_bytes()
    return out


@contextlib.contextmanager
def _time_limit():
    def too_long(*_):
        raise TimeoutError(f"over {LIMIT_S} s")

    signal.signal(signal.SIGALRM, too_long)
    signal.alarm(LIMIT_S)
    try:
        yield
    finally:
        signal.alarm(0)


def _failure(err: BaseException) -> str:
    """The error, with the deepest frame of ours it passed through."""
    ours = [f for f in traceback.extract_tb(err.__traceback__) if "souffle_tvm" in f.filename]
    where = f" @ {Path(ours[-1].filename).name}:{ours[-1].lineno}" if ours else ""
    return f"{type(err).__name__}: {err}{where}"


def _row(name: str, outcome: str, message: str, started: float) -> dict:
    return {"name": name, "outcome": outcome, "message": " ".join(message.split())[:400],
            "seconds": round(time.perf_counter() - started, 2)}


def compile_one(name: str, blob: bytes) -> dict:
    """One model's outcome: ok, refused (a SouffleError) or crash, with what was said."""
    import onnx

    from souffle_tvm.errors import SouffleError
    from souffle_tvm.pipeline.driver import compile as compile_model

    t = time.perf_counter()
    try:
        with _time_limit():
            r = compile_model(onnx.load_from_string(blob), "cuda", "souffle", nvcc=False).report
        outcome, message = "ok", f"{r.fusion} {r.launches} launches" + (" (fallback)" if r.fallback else "")
    except SouffleError as err:
        outcome, message = "refused", f"{type(err).__name__}: {err}"
    except Exception as err:  # noqa: BLE001 - a crash is what this looks for
        outcome, message = "crash", _failure(err)
    return _row(name, outcome, message, t)


def _differs(name: str, got, want) -> str | None:
    """Why ``got`` is not ``want``: NaN and infinities where the reference has them (random inputs
    outside an op's domain: acos of 2), the rest within relative L2 1e-3 (1e-2 for float16)."""
    import numpy as np

    g, w = np.asarray(got), np.asarray(want)
    if g.shape != w.shape:
        return f"{name}: shape {g.shape} against {w.shape}"
    if g.dtype.kind not in "fc":
        return None if np.array_equal(g, w) else f"{name}: {int(np.sum(g != w))} of {g.size} differ"
    g64, w64 = g.astype(np.float64), w.astype(np.float64)
    special = ~np.isfinite(w64)
    if not np.array_equal(np.isnan(g64), np.isnan(w64)) or not np.array_equal(g64[special & ~np.isnan(w64)],
                                                                           w64[special & ~np.isnan(w64)]):
        return f"{name}: NaN or infinity where the reference has none, or not where it has"
    if np.any(~np.isfinite(g64[~special])):
        return f"{name}: NaN or infinity where the reference is finite"
    rel = np.linalg.norm(g64[~special] - w64[~special]) / max(np.linalg.norm(w64[~special]), 1e-30)
    return f"{name}: rel L2 {rel:.2e}" if rel > (1e-2 if g.dtype == np.float16 else 1e-3) else None


def emulate_one(name: str, blob: bytes, seed: int = 0) -> dict:
    """The default level's CUDA module (before TVM's build: our kernels as scheduled and stitched)
    run in the GPU emulator on seeded inputs, against onnxruntime: match, mismatch (a wrong
    kernel), or not emulated (the emulator or the reference cannot run it, with why)."""
    import onnx
    import tvm

    from souffle_tvm.core.targets import make_target
    from souffle_tvm.frontend.importer import import_onnx
    from souffle_tvm.pipeline import results
    from souffle_tvm.pipeline.options import Options
    from souffle_tvm.runtime import emulate, runner

    t = time.perf_counter()
    try:
        with _time_limit():
            m = import_onnx(onnx.load_from_string(blob))
            souffle = results.run(m.mod, make_target("cuda"), m.params, Options(level="auto").resolved())
            feeds = runner.random_inputs(m.inputs, seed)
            try:
                _, ref = runner.reference_outputs(m.onnx_model, feeds)
            except Exception as err:  # noqa: BLE001 - onnxruntime refuses the random inputs (indices, shapes)
                raise LookupError(f"no reference: {str(err).splitlines()[0][:200]}") from None
            ex = tvm.compile(emulate.emulate_module(souffle.mod, make_target("cuda")), target=make_target("llvm"))
            outs = runner.run_vm(ex, souffle.params, runner.check_feeds(m.inputs, feeds))
        bad = [why for output, got, want in zip(m.outputs, outs, ref) if (why := _differs(output, got, want))]
        outcome = "mismatch" if bad else "match"
        message = "; ".join(bad) or f"{len(souffle.stitched)} stitched"
    except Exception as err:  # noqa: BLE001 - recorded, with the deepest frame of ours
        outcome, message = "not emulated", _failure(err)
    return _row(name, outcome, message, t)


def run(out: Path, shard: int, shards: int, only: str | None, emulated: bool = False) -> None:
    warnings.filterwarnings("ignore")
    one = emulate_one if emulated else compile_one
    blobs = models()
    done = {json.loads(line)["name"] for line in out.read_text().splitlines()} if out.exists() else set()
    names = [n for n in sorted(blobs)[shard::shards] if n not in done and (not only or only in n)]
    with out.open("a") as fh:
        for i, name in enumerate(names):
            row = one(name, blobs[name])
            fh.write(json.dumps(row) + "\n")
            fh.flush()
            print(f"[{i + 1}/{len(names)}] {name}: {row['outcome']}", file=sys.stderr, flush=True)


def table(rows: list[dict], before: list[dict] | None) -> str:
    counts = Counter(r["outcome"] for r in rows)
    lines = ["| outcome | models |" + (" before |" if before else ""), "| --- | --- |" + (" --- |" if before else "")]
    old = Counter(r["outcome"] for r in before) if before else None
    for k in ("ok", "refused", "crash", "match", "mismatch", "not emulated"):
        if not counts.get(k) and not (old and old.get(k)):
            continue
        lines.append(f"| {k} | {counts.get(k, 0)} |" + (f" {old.get(k, 0)} |" if old else ""))
    crashes = [r for r in rows if r["outcome"] in ("crash", "mismatch")]
    if crashes:
        lines += ["", "| crash or mismatch | message |", "| --- | --- |"] + [f"| {r['name']} | {r['message']} |" for r in crashes]
    if before:
        was = {r["name"]: r for r in before}
        fixed = [r for r in rows if r["outcome"] != "crash" and was.get(r["name"], {}).get("outcome") == "crash"]
        if fixed:
            lines += ["", "| crashed before | before | now |", "| --- | --- | --- |"] + \
                     [f"| {r['name']} | {was[r['name']]['message'][:160]} | {r['outcome']} |" for r in fixed]
    refused = Counter(r["message"].split(":")[0] for r in rows if r["outcome"] in ("refused", "not emulated"))
    lines += ["", "| refused or not emulated: the error | models |", "| --- | --- |"] + [f"| {k} | {v} |" for k, v in refused.most_common()]
    return "\n".join(lines)


def _read(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__.strip())
        return 0
    if len(argv) >= 2 and argv[0] == "run":
        args = [a for a in argv[2:] if a != "--emulate"]
        opt = dict(zip(args[::2], args[1::2]))
        run(Path(argv[1]), int(opt.get("--shard", 0)), int(opt.get("--shards", 1)), opt.get("--only"),
            "--emulate" in argv)
    elif len(argv) >= 2 and argv[0] == "table":
        print(table(_read(argv[1]), _read(argv[2]) if len(argv) > 2 else None))
    else:
        raise SystemExit(__doc__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
