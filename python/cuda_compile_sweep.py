"""Every model of ONNX's conformance suite compiled for CUDA at the default level: which compile,
which are refused with the project's clear error, which crash.

    python python/cuda_compile_sweep.py run OUT.jsonl [--shard I --shards N] [--only SUBSTRING]
    python python/cuda_compile_sweep.py table OUT.jsonl [BEFORE.jsonl] > results.md

``onnx_conformance.py`` runs the suite on llvm (numerics); this compiles the same models for
``cuda`` (sm_90) with ``--fusion souffle`` at the default level, which stitches, prices and builds
TVM's kernels too, without nvcc (CUDA codegen still runs; a kernel CUDA cannot hold fails there).
Models: the node tests the onnx package makes and its shipped simple, pytorch-converted and
pytorch-operator models (nothing downloaded). Outcomes: ok; refused (a ``SouffleError``: the
clear error a user gets); crash (anything else, with the deepest frame of ours). Each model
has 120 s; a run resumes where OUT.jsonl stops, so a shard killed half-way loses one model.
"""

from __future__ import annotations

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


def compile_one(name: str, blob: bytes) -> dict:
    """One model's outcome: ok, refused (a SouffleError) or crash, with what was said."""
    import onnx

    from souffle_tvm.errors import SouffleError
    from souffle_tvm.pipeline.driver import compile as compile_model

    def too_long(*_):
        raise TimeoutError(f"over {LIMIT_S} s")

    signal.signal(signal.SIGALRM, too_long)
    signal.alarm(LIMIT_S)
    t = time.perf_counter()
    try:
        r = compile_model(onnx.load_from_string(blob), "cuda", "souffle", nvcc=False).report
        outcome, message = "ok", f"{r.fusion} {r.launches} launches" + (" (fallback)" if r.fallback else "")
    except SouffleError as err:
        outcome, message = "refused", f"{type(err).__name__}: {err}"
    except Exception as err:  # noqa: BLE001 - a crash is what this looks for
        ours = [f for f in traceback.extract_tb(err.__traceback__) if "souffle_tvm" in f.filename]
        where = f" @ {Path(ours[-1].filename).name}:{ours[-1].lineno}" if ours else ""
        outcome, message = "crash", f"{type(err).__name__}: {err}{where}"
    finally:
        signal.alarm(0)
    return {"name": name, "outcome": outcome, "message": " ".join(message.split())[:400],
            "seconds": round(time.perf_counter() - t, 2)}


def run(out: Path, shard: int, shards: int, only: str | None) -> None:
    warnings.filterwarnings("ignore")
    blobs = models()
    done = {json.loads(line)["name"] for line in out.read_text().splitlines()} if out.exists() else set()
    names = [n for n in sorted(blobs)[shard::shards] if n not in done and (not only or only in n)]
    with out.open("a") as fh:
        for i, name in enumerate(names):
            row = compile_one(name, blobs[name])
            fh.write(json.dumps(row) + "\n")
            fh.flush()
            print(f"[{i + 1}/{len(names)}] {name}: {row['outcome']}", file=sys.stderr, flush=True)


def table(rows: list[dict], before: list[dict] | None) -> str:
    counts = Counter(r["outcome"] for r in rows)
    lines = ["| outcome | models |" + (" before |" if before else ""), "| --- | --- |" + (" --- |" if before else "")]
    old = Counter(r["outcome"] for r in before) if before else None
    for k in ("ok", "refused", "crash"):
        lines.append(f"| {k} | {counts.get(k, 0)} |" + (f" {old.get(k, 0)} |" if old else ""))
    crashes = [r for r in rows if r["outcome"] == "crash"]
    if crashes:
        lines += ["", "| crash | message |", "| --- | --- |"] + [f"| {r['name']} | {r['message']} |" for r in crashes]
    if before:
        was = {r["name"]: r for r in before}
        fixed = [r for r in rows if r["outcome"] != "crash" and was.get(r["name"], {}).get("outcome") == "crash"]
        if fixed:
            lines += ["", "| crashed before | before | now |", "| --- | --- | --- |"] + \
                     [f"| {r['name']} | {was[r['name']]['message'][:160]} | {r['outcome']} |" for r in fixed]
    refused = Counter(r["message"].split(":")[0] for r in rows if r["outcome"] == "refused")
    lines += ["", "| refused with | models |", "| --- | --- |"] + [f"| {k} | {v} |" for k, v in refused.most_common()]
    return "\n".join(lines)


def _read(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "run":
        opt = dict(zip(argv[2::2], argv[3::2]))
        run(Path(argv[1]), int(opt.get("--shard", 0)), int(opt.get("--shards", 1)), opt.get("--only"))
    elif len(argv) >= 2 and argv[0] == "table":
        print(table(_read(argv[1]), _read(argv[2]) if len(argv) > 2 else None))
    else:
        raise SystemExit(__doc__)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.exit(main(sys.argv[1:]))
