"""The import table of issue 3: PyTorch exports (legacy / dynamo) x small models, imported before
and after the folding step, then built for llvm and compared with onnxruntime.

"before" is TVM's importer on the file as exported (``import_onnx(fold=False)``) with only the
converters that existed before this work (LSTM; no GRU); "after" is ``import_onnx`` as shipped.

    .venv/bin/python python/import_matrix.py
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


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    print("| model | exporter | before (plain TVM import) | after (fold + import + llvm build vs onnxruntime) |")
    print("| --- | --- | --- | --- |")
    for name in tm.SPECS:
        for exporter in tm.EXPORTERS:
            path, shapes = tm.export(name, exporter), tm.input_shapes(name, BATCH)
            print(f"| {name} | {exporter} | {before(path, shapes)} | {after(name, path, shapes)} |", flush=True)


if __name__ == "__main__":
    main()
