"""``souffle-tvm run``: run a model (or a library ``compile -o`` exported) on seeded or given
inputs, optionally timed and checked against onnxruntime."""

from __future__ import annotations

import os
import time

import numpy as np

from ..errors import SouffleError
from ..frontend.binding import parse_bind
from .options import EXIT_MISMATCH, EXIT_OK, load_inputs, parse_shapes, writable


def load_library(path: str):
    import tvm

    meta_path = f"{path}.params.npz"
    if not os.path.exists(meta_path):
        raise SouffleError(f"{meta_path} not found: a library made by `souffle-tvm compile -o` has its weights beside it")
    meta = np.load(meta_path)
    target = str(meta["__target__"])
    if not target.startswith("llvm"):
        raise SouffleError(f"{path} was built for {target}; only llvm libraries run on this CPU "
                           "(rebuild with --target llvm)")
    from ..frontend.importer import TensorInfo

    inputs = []
    for row in meta["__inputs__"]:
        name, dims, dtype = str(row).split("|")
        inputs.append(TensorInfo(name, tuple(int(d) for d in dims.split("x") if d), dtype))
    params = [meta[k] for k in sorted(k for k in meta.files if k.startswith("param_"))]
    return tvm.runtime.load_module(path), params, inputs, [str(o) for o in meta["__outputs__"]]


def cmd_run(args) -> int:
    from ..runtime import runner

    writable(args.outputs, "--outputs")
    feeds = load_inputs(args.inputs)
    device = runner.cuda_device() if args.target == "cuda" else None    # no GPU: say so before compiling
    if device is not None and args.model.endswith(".so"):
        raise SouffleError("run --target cuda compiles the model: give the .onnx file or the zoo name")
    given = f"--inputs {args.inputs}"
    if args.model.endswith(".so"):
        if args.check:
            raise SouffleError("--check needs the ONNX model: run it on the .onnx file or the zoo name")
        executable, params, inputs, output_names = load_library(args.model)
        if feeds is not None:
            runner.check_given({i.name: i.dtype for i in inputs}, feeds, given)
        model, model_precision = None, None
    else:
        from ..frontend.binding import bind_inputs
        from ..frontend.importer import graph_inputs, input_types, load_model, shapes_from_arrays
        from ..pipeline.driver import compile as compile_model

        shapes = parse_shapes(args.input_shapes)
        onnx_model = bind_inputs(load_model(args.model, args.small, args.dtype)[1], parse_bind(args.bind))
        if feeds is not None:
            # Arrays that do not fit the model are refused before compiling; dynamic input dims
            # take the given arrays' shapes, though --input-shapes still wins.
            runner.check_given(input_types(onnx_model), feeds, given)
            shapes = {**shapes_from_arrays(onnx_model, feeds), **(shapes or {})}
            runner.check_feeds(graph_inputs(onnx_model, shapes), feeds)
        else:
            # seeded inputs of the shapes asked for must fit in memory: say so before compiling
            runner.check_memory(graph_inputs(onnx_model, shapes))
        compiled = compile_model(args.model, args.target, args.fusion, small=args.small, dtype=args.dtype,
                                 shapes=shapes, level=args.level, bind=parse_bind(args.bind))
        executable, params = compiled.executable, compiled.model.params
        inputs, output_names, model = compiled.model.inputs, compiled.model.outputs, compiled.model.onnx_model
        model_precision = compiled.model.precision
    feeds = feeds if feeds is not None else runner.random_inputs(inputs, args.seed)
    ordered = runner.check_feeds(inputs, feeds)
    t = time.perf_counter()
    outs = runner.run_vm(executable, params, ordered, device)
    print(f"ran on {args.target} in {time.perf_counter() - t:.3f} s")
    if args.time:
        ms = runner.median_ms(executable, params, ordered, args.time, device)
        print(f"median of {args.time} runs: {ms:.4f} ms")
    for name, o in zip(output_names, outs):
        print(f"  {name}: shape {tuple(o.shape)} {o.dtype} mean {float(np.mean(o)) if o.size else float('nan'):.6g}")
    if args.outputs:
        np.savez(args.outputs, **dict(zip(output_names, outs)))
        print(f"outputs: {args.outputs}")
    if not args.check:
        return EXIT_OK
    try:
        ref_name, ref = runner.checked_reference(model, {i.name: a for i, a in zip(inputs, ordered)})
    except SouffleError as err:
        raise SouffleError(f"--check: {err}; the outputs above are unchecked (run without --check)") from None
    computes_in = model_precision or (inputs[0].dtype if inputs else "float32")
    tol = args.tolerance or runner.default_tolerance(computes_in)
    ok = True
    for c in runner.compare(output_names, outs, ref):
        status = "ok" if c.ok(tol) else "MISMATCH"
        ok &= c.ok(tol)
        print(f"  check {c.name} vs {ref_name}: rel L2 {c.rel_l2:.3e}  max |diff| {c.max_abs:.3e}  {status}")
    return EXIT_OK if ok else EXIT_MISMATCH
