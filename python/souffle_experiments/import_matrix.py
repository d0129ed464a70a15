"""The import table of issue 3: PyTorch exports (legacy / dynamo) x small models, imported before
and after the folding step, then built for llvm and compared with onnxruntime.

"before" is TVM's importer on the file as exported (``import_onnx(fold=False)``) with only the
converters that existed before this work (LSTM; no GRU); "after" is ``import_onnx`` as shipped.
The last column builds the export for CUDA (sm_90) with ``--fusion souffle`` at the default
level (auto: v3, time-driven, kept or replaced by TVM's own build) and nvcc (``cuda_default``).

    .venv/bin/python -m souffle_experiments import-matrix            # + each export built for CUDA at the default level
    .venv/bin/python -m souffle_experiments import-matrix --names     # both fusions x three exporters' name styles

``--names``: every export of ``ROWS`` (the matrix, the CNNs with batch norm kept, the encoders
with dynamic batch and sequence at two shapes) renamed in torch's, TF/Keras' and JAX's
tensor-name styles (``torch_models.rename``), each built for llvm with ``--fusion tvm`` and
``--fusion souffle`` (the default level) and compared with onnxruntime on the renamed file.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from souffle_tvm.frontend import onnx_rnn
from souffle_tvm.frontend.importer import import_onnx
from souffle_tvm.pipeline.driver import compile as compile_model
from souffle_tvm.runtime import runner

from .paths import checkout_module

# the test suite's exporter matrix (PyTorch models, their exports, inputs and renames): a file
# of the checkout's tests/, imported by its path as the tests import it (``torch_models``)
tm = checkout_module("tests/torch_models.py")

BATCH = 3
# The rows of --names: (model, exporter, batch, sequence length or None). The SPECS x EXPORTERS
# matrix at batch 3; then the CNNs exported with inference BatchNormalization kept, and the
# encoders exported with batch and sequence dynamic (three int64 inputs), each at two shapes.
ROWS = ([(n, e, BATCH, None) for n in tm.SPECS for e in tm.EXPORTERS]
        + [(n, e, BATCH, None) for n in tm.BN_MODELS for e in tm.BN_EXPORTERS]
        + [(n, e, b, s) for n in ("bert", "hfbert") for e in ("legacy-seq", "dynamo-seq") for b, s in ((3, 5), (2, 12))])


def _short(err: Exception) -> str:
    text = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
    return text.split("failed: ", 1)[-1][:110]


def before(path: str, shapes: dict) -> str:
    saved = dict(onnx_rnn.CONVERTERS)
    onnx_rnn.CONVERTERS.pop("GRU", None)
    try:
        import_onnx(path, shapes=shapes, fold=False)
        return "ok"
    except Exception as err:  # noqa: BLE001 - the table records whatever went wrong
        return f"FAIL: {_short(err)}"
    finally:
        onnx_rnn.CONVERTERS.clear()
        onnx_rnn.CONVERTERS.update(saved)


def after(name: str, path: str, shapes: dict) -> str:
    try:
        compiled = compile_model(path, "llvm", "tvm", shapes=shapes)
    except Exception as err:  # noqa: BLE001
        return f"FAIL: {_short(err)}"
    feeds = tm.example_inputs(name, seed=1, batch=BATCH)
    outs = runner.run_vm(compiled.executable, compiled.model.params, runner.check_feeds(compiled.model.inputs, feeds))
    _, ref = runner.reference_outputs(compiled.model.onnx_model, feeds)
    worst = max(c.rel_l2 for c in runner.compare(compiled.model.outputs, outs, ref))
    return f"ok, rel L2 {worst:.1e}"


def cuda_default(path: str, shapes: dict) -> str:
    """The export built for CUDA sm_90 at the default level with nvcc (nothing runs: no GPU here)."""
    try:
        c = compile_model(path, "cuda", "souffle", shapes=shapes)
    except Exception as err:  # noqa: BLE001 - the table records whatever went wrong
        return f"FAIL: {_short(err)}"
    r = c.report
    if not r.nvcc.get("available"):
        return "built, not checked (no nvcc)"
    spills = sum(k.spill_bytes or 0 for k in r.kernels)
    kept = "TVM's kernels kept" if r.fallback else "Souffle's kept"
    return (f"builds, {r.launches} launches, {kept}" + (f", {spills} B spilled" if spills else ""))


def renamed(name: str, exporter: str, style: str, batch: int, seq: int | None, folder: str) -> tuple[str, dict, dict]:
    """The export renamed in ``style``, saved in ``folder``; its input shapes and example inputs
    under the renamed graph inputs' names."""
    import onnx

    model = tm.rename(onnx.load(tm.export(name, exporter)), style)
    path = os.path.join(folder, f"{name}-{exporter}-{style}.onnx")
    onnx.save(model, path)
    prefix = {"tf": "serving_default_", "jax": "jax2tf_arg_"}.get(style)   # rename's graph-input names
    new = (lambda k: f"{prefix}{k}:0") if prefix else (lambda k: k)
    shapes = {new(k): v for k, v in tm.input_shapes(name, batch, seq).items()}
    feeds = {new(k): v for k, v in tm.example_inputs(name, seed=1, batch=batch, seq=seq).items()}
    assert {vi.name for vi in model.graph.input} - {t.name for t in model.graph.initializer} == set(shapes)
    return path, shapes, feeds


def styled(name: str, exporter: str, batch: int, seq: int | None, style: str, fusion: str) -> str:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path, shapes, feeds = renamed(name, exporter, style, batch, seq, d)
        try:
            compiled = compile_model(path, "llvm", fusion, shapes=shapes)
            outs = runner.run_vm(compiled.executable, compiled.model.params,
                                 runner.check_feeds(compiled.model.inputs, feeds))
            _, ref = runner.reference_outputs(compiled.model.onnx_model, feeds)
        except Exception as err:  # noqa: BLE001 - the table records whatever went wrong
            return f"FAIL: {_short(err)}"
        worst = max(c.rel_l2 for c in runner.compare(compiled.model.outputs, outs, ref))
        path_taken = "" if fusion == "tvm" or not compiled.report.fallback else " (fell back)"
        return f"{worst:.1e}{path_taken}"


def cuda_build(name: str, exporter: str, batch: int, seq: int | None, style: str, fusion: str, level: str) -> str:
    """Build the renamed export for CUDA sm_90 with nvcc (nothing runs: no GPU here)."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path, shapes, _ = renamed(name, exporter, style, batch, seq, d)
        try:
            c = compile_model(path, "cuda", fusion, shapes=shapes, level=level)
        except Exception as err:  # noqa: BLE001
            return f"FAIL: {_short(err)}"
    spills = sum(k.spill_bytes or 0 for k in c.report.kernels)
    return "builds" + (f", {spills} B spilled" if spills else "") + (" (fell back)" if c.report.fallback else "")


def table(cols: list, header: str, cell) -> None:
    """One row per ROWS entry, one cell per column; rows print as they finish (times on stderr)."""
    print("| model | exporter | inputs | " + " | ".join(header(*c) for c in cols) + " |")
    print("| --- | --- | --- | " + " | ".join("---" for _ in cols) + " |")
    for name, exporter, batch, seq in ROWS:
        start = time.perf_counter()
        cells = [cell(name, exporter, batch, seq, *c) for c in cols]
        inputs = f"batch {batch}" + (f", seq {seq}" if seq else "")
        print(f"| {name} | {exporter} | {inputs} | " + " | ".join(cells) + " |", flush=True)
        print(f"{name} {exporter} {inputs}: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)


def cuda_table(styles: tuple) -> None:
    cols = [(s, f, lv) for s in styles for f, lv in (("tvm", "v2"), ("souffle", "v2"), ("souffle", "v3"))]
    table(cols, lambda s, f, lv: f"{s} names, {f if f == 'tvm' else lv}", cuda_build)


def names_table() -> None:
    cols = [(s, f) for s in tm.NAME_STYLES for f in ("tvm", "souffle")]
    table(cols, lambda s, f: f"{s} names, {f}", styled)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--names", action="store_true", help="both fusions x torch, TF and JAX name styles")
    ap.add_argument("--cuda", action="store_true", help="with --names: build the TF- and JAX-named exports for "
                    "CUDA sm_90 with nvcc at tvm, v2 and v3 instead")
    args = ap.parse_args(argv)
    if args.names and args.cuda:
        return cuda_table(("tf", "jax"))
    if args.names:
        return names_table()
    print("| model | exporter | before (plain TVM import) | after (fold + import + llvm build vs onnxruntime) "
          "| CUDA, souffle at the default level (nvcc) |")
    print("| --- | --- | --- | --- | --- |")
    for name in tm.SPECS:
        for exporter in tm.EXPORTERS:
            path, shapes = tm.export(name, exporter), tm.input_shapes(name, BATCH)
            start = time.perf_counter()
            print(f"| {name} | {exporter} | {before(path, shapes)} | {after(name, path, shapes)} "
                  f"| {cuda_default(path, shapes)} |", flush=True)
            print(f"{name} {exporter}: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
