"""The import table of issue 3: PyTorch exports (legacy / dynamo) x small models, imported before
and after the folding step, then built for llvm and compared with onnxruntime.

"before" is TVM's importer on the file as exported (``import_onnx(fold=False)``) with only the
converters that existed before this work (LSTM; no GRU); "after" is ``import_onnx`` as shipped.

    .venv/bin/python python/import_matrix.py
    .venv/bin/python python/import_matrix.py --names     # both fusions x three exporters' name styles

``--names``: every export renamed in torch's, TF/Keras' and JAX's tensor-name styles
(``torch_models.rename``), each built for llvm with ``--fusion tvm`` and ``--fusion souffle``
(the default level) and compared with onnxruntime on the renamed file.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import torch_models as tm  # noqa: E402

from souffle_tvm.runtime import runner  # noqa: E402
from souffle_tvm.frontend import onnx_rnn
from souffle_tvm.pipeline.driver import compile as compile_model  # noqa: E402
from souffle_tvm.frontend.importer import import_onnx  # noqa: E402

BATCH = 3


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


def styled(name: str, exporter: str, style: str, fusion: str) -> str:
    import tempfile

    import onnx

    path, shapes = tm.export(name, exporter), tm.input_shapes(name, BATCH)
    model = tm.rename(onnx.load(path), style)
    with tempfile.TemporaryDirectory() as d:
        renamed = os.path.join(d, f"{name}-{style}.onnx")
        onnx.save(model, renamed)

        def new_name(k: str) -> str:      # torch_models.rename's names for graph inputs
            return {"tf": f"serving_default_{k}:0", "jax": f"jax2tf_arg_{k}:0"}.get(style, k)

        feeds = {new_name(k): v for k, v in tm.example_inputs(name, seed=1, batch=BATCH).items()}
        shapes = {new_name(k): v for k, v in shapes.items()}
        try:
            compiled = compile_model(renamed, "llvm", fusion, shapes=shapes)
            outs = runner.run_vm(compiled.executable, compiled.model.params,
                                 runner.check_feeds(compiled.model.inputs, feeds))
            _, ref = runner.reference_outputs(compiled.model.onnx_model, feeds)
        except Exception as err:  # noqa: BLE001 - the table records whatever went wrong
            return f"FAIL: {_short(err)}"
        worst = max(c.rel_l2 for c in runner.compare(compiled.model.outputs, outs, ref))
        path_taken = "" if fusion == "tvm" or not compiled.report.fallback else " (fell back)"
        return f"{worst:.1e}{path_taken}"


def cuda_build(name: str, exporter: str, style: str, fusion: str, level: str) -> str:
    """Build the renamed export for CUDA sm_90 with nvcc (nothing runs: no GPU here)."""
    import tempfile

    import onnx

    path, shapes = tm.export(name, exporter), tm.input_shapes(name, BATCH)
    prefix = {"tf": "serving_default_", "jax": "jax2tf_arg_"}.get(style, "")
    shapes = {(f"{prefix}{k}:0" if prefix else k): v for k, v in shapes.items()}
    with tempfile.TemporaryDirectory() as d:
        renamed = os.path.join(d, f"{name}-{style}.onnx")
        onnx.save(tm.rename(onnx.load(path), style), renamed)
        try:
            c = compile_model(renamed, "cuda", fusion, shapes=shapes, level=level)
        except Exception as err:  # noqa: BLE001
            return f"FAIL: {_short(err)}"
    spills = sum(k.spill_bytes or 0 for k in c.report.kernels)
    return "builds" + (f", {spills} B spilled" if spills else "") + (" (fell back)" if c.report.fallback else "")


def cuda_table(styles: tuple) -> None:
    cols = [(s, f, lv) for s in styles for f, lv in (("tvm", "v2"), ("souffle", "v2"), ("souffle", "v3"))]
    print("| model | exporter | " + " | ".join(f"{s} names, {f if f == 'tvm' else lv}" for s, f, lv in cols) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in cols) + " |")
    for name in tm.SPECS:
        for exporter in tm.EXPORTERS:
            cells = [cuda_build(name, exporter, s, f, lv) for s, f, lv in cols]
            print(f"| {name} | {exporter} | " + " | ".join(cells) + " |", flush=True)


def names_table() -> None:
    cols = [(s, f) for s in tm.NAME_STYLES for f in ("tvm", "souffle")]
    print("| model | exporter | " + " | ".join(f"{s} names, {f}" for s, f in cols) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in cols) + " |")
    for name in tm.SPECS:
        for exporter in tm.EXPORTERS:
            cells = [styled(name, exporter, s, f) for s, f in cols]
            print(f"| {name} | {exporter} | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--names", action="store_true", help="both fusions x torch, TF and JAX name styles")
    ap.add_argument("--cuda", action="store_true", help="with --names: build the TF- and JAX-named exports for "
                    "CUDA sm_90 with nvcc at tvm, v2 and v3 instead")
    args = ap.parse_args()
    if args.names and args.cuda:
        return cuda_table(("tf", "jax"))
    if args.names:
        return names_table()
    print("| model | exporter | before (plain TVM import) | after (fold + import + llvm build vs onnxruntime) |")
    print("| --- | --- | --- | --- |")
    for name in tm.SPECS:
        for exporter in tm.EXPORTERS:
            path, shapes = tm.export(name, exporter), tm.input_shapes(name, BATCH)
            print(f"| {name} | {exporter} | {before(path, shapes)} | {after(name, path, shapes)} |", flush=True)


if __name__ == "__main__":
    main()
