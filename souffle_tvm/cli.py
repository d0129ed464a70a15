"""``souffle-tvm``: compile, run and inspect models, in the manner of the former ``tvmc``.

Exit codes: 0 success; 1 ``run --check`` found a numerical mismatch; 2 bad input or an
unavailable feature (the message says which); 3 an internal error (a bug: please report).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import zipfile
import warnings

import numpy as np

from .core import progress
from . import zoo
from .errors import DynamicShapeError, MiscompileError, SouffleError, SouffleWarning, UnknownInputError
from .frontend.binding import parse_bind

EXIT_OK, EXIT_MISMATCH, EXIT_INPUT, EXIT_INTERNAL = 0, 1, 2, 3


def _input_args(p: argparse.ArgumentParser) -> None:
    """Which model, at which size, precision and input shapes (every command that imports one)."""
    p.add_argument("model", help="an ONNX file, or a zoo model name (see `souffle-tvm zoo list`)")
    p.add_argument("--small", action="store_true", help="zoo models: the small variant (same structure)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16"],
                   help="zoo models: precision of weights and activations (bert and swin also in float16)")
    p.add_argument("--input-shapes", default=None, metavar="NAME:1x128,...",
                   help="fix the shapes of dynamic model inputs")
    p.add_argument("--bind", action="append", default=None, metavar="NAME=VALUE",
                   help="fix a model input to a value at compile time (a number, true/false, or an "
                        "array.npy), e.g. a configuration input an If branches on; repeatable")


def _model_args(p: argparse.ArgumentParser) -> None:
    _input_args(p)
    p.add_argument("--fusion", default="tvm", choices=["tvm", "souffle"],
                   help="kernel fusion: tvm (default) = TVM's rule-based FuseOps, or souffle = Souffle's "
                        "global-analysis pipeline (its level: --level)")
    p.add_argument("--level", default="auto",
                   help="souffle pipeline level: auto (default) = v3 with the time-driven partitioner, and on "
                        "CUDA TVM's own build instead where the latency model predicts it faster; "
                        "v0 no transforms, v1 + horizontal, v2 + vertical, "
                        "v3 + two-phase reductions and stitched cooperative kernels, "
                        "v4 + L2 prefetch of each stitched kernel's next-segment inputs")
    p.add_argument("--gemm-k-tile", type=int, default=None, metavar="N",
                   help="v3 on CUDA: K tile of the stitched SIMT GEMM stages (default: per GEMM, 16, 32 "
                        "or 64 as the latency model predicts fastest); tiles over 48 KB go to dynamic "
                        "shared memory")
    p.add_argument("--gemm-tile", type=int, default=None, choices=[16, 32, 64], metavar="N",
                   help="v3 on CUDA: output tile side of the stitched SIMT GEMM stages, 16, 32 or 64 "
                        "(default: per GEMM, the one the latency model predicts fills the stitched grid best)")
    p.add_argument("--reduction", default="deterministic", choices=["deterministic", "atomic"],
                   help="v3 on CUDA: two-phase reductions with a partial buffer and a combine (default), "
                        "or fp32 sums accumulated with atomicAdd")
    p.add_argument("--partitioner", default=None, choices=["budget", "time", "blocks"],
                   help="v3: budget = boundaries only where a resource or the compile-time budget forces one "
                        "(the default of an explicit --level v3/v4); time = also where the latency model "
                        "predicts separate kernels faster (the default of --level auto); "
                        "blocks = one kernel per attention / FFN block")


SHAPES_FORM = "NAME:DxD... with each D a whole size of 1 or more, e.g. x:1x128; items separated by commas"


def _parse_shapes(text: str | None) -> dict | None:
    """``--input-shapes NAME:DxD,...`` as {name: dims}."""
    if not text:
        return None
    shapes = {}
    for item in text.split(","):
        name, _, dims = item.rpartition(":")
        try:
            shape = tuple(int(d) for d in dims.split("x"))
        except ValueError:
            shape = ()
        if not name or not shape or min(shape) < 1:
            raise SouffleError(f"--input-shapes {item!r}: expected {SHAPES_FORM}")
        shapes[name] = shape
    return shapes


def _writable(path: str | None, option: str) -> None:
    """Before any work: the file an option names can be written (its folder exists and is
    writable, and it is not a folder itself)."""
    if not path:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise SouffleError(f"{option} {path}: is a folder; give a file name")
    if not os.path.isdir(folder):
        raise SouffleError(f"{option} {path}: the folder {folder} does not exist (create it first)")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise SouffleError(f"{option} {path}: cannot be written here (permissions); choose another path")


def _load_inputs(path: str | None) -> dict | None:
    """The arrays of ``--inputs``: an .npz of named arrays (no pickled objects)."""
    if path is None:
        return None
    if not os.path.isfile(path):
        raise SouffleError(f"--inputs {path}: no such file")
    try:
        with np.load(path, allow_pickle=False) as data:
            if not hasattr(data, "files"):
                raise ValueError("a single array, not an archive of named arrays")
            return {k: data[k] for k in data.files}
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as err:
        cut = f" (cut short? {str(err).splitlines()[0][:120]})" if isinstance(err, (EOFError, zipfile.BadZipFile)) else ""
        raise SouffleError(f"--inputs {path}: not a readable .npz of named arrays (np.savez writes one){cut}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="souffle-tvm", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="exit codes: 0 ok, 1 numerical mismatch, 2 bad input, 3 internal error")
    _add_global_flags(parser)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_report_parser(sub)

    p = sub.add_parser("compile", help="build a model and write its report")
    _model_args(p)
    p.add_argument("--target", default="cuda", help="cuda (default sm_90), 'cuda -arch=sm_80', or llvm")
    p.add_argument("--arch", default=None, help="CUDA architecture, e.g. sm_80 or sm_90 (default sm_90)")
    p.add_argument("-o", "--output", default=None, help="export the library to this .so (weights beside it)")
    p.add_argument("--report", default=None, help="write the report as JSON to this file")
    p.add_argument("--no-nvcc", action="store_true", help="skip ptxas resource measurement")
    p.add_argument("--cuda-graph", action="store_true",
                   help="CUDA: build with TVM's CUDA-graph rewriting (kernels on static buffers replayed from "
                        "graphs; the report counts the launches left outside)")
    p.add_argument("--off-chip", action="store_true",
                   help="--fusion souffle: keep every intermediate and weight in global memory (no on-chip "
                        "channels, row chains, prologues, window chains or resident weights), for comparison")
    p.add_argument("--count-traffic", action="store_true",
                   help="CUDA: run the built kernels in the GPU emulator (on the CPU) and report the traffic they "
                        "execute beside the analytic bytes: distinct bytes, 32-byte sectors per warp request "
                        "(coalescing), shared-memory accesses (small models: it takes seconds to minutes)")
    p.add_argument("--database", default=None, metavar="DIR",
                   help="--fusion souffle: apply the tuned schedules `souffle-tvm tune` wrote to DIR "
                        "(stages it does not hold keep the default rules; the report says which)")

    p = sub.add_parser("run", help="run a model on the CPU (llvm) and optionally check it against onnxruntime")
    _model_args(p)
    p.add_argument("--inputs", default=None, help=".npz with one array per model input (default: seeded random)")
    p.add_argument("--outputs", default=None, help="save the outputs to this .npz")
    p.add_argument("--check", action="store_true", help="compare with onnxruntime (exit 1 on mismatch)")
    p.add_argument("--tolerance", type=float, default=None, help="relative L2 tolerance (1e-5 fp32, 1e-2 fp16)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p.add_argument("--target", default="llvm", choices=["llvm", "cuda"],
                   help="where to run: this CPU (default) or the first CUDA GPU (needs one and TVM's CUDA runtime)")
    p.add_argument("--time", type=int, default=None, metavar="N",
                   help="also print the median time of N runs after a warm-up (synchronised with the device)")

    p = sub.add_parser("analyze", help="the whole model as tensor expressions: stage kinds, index maps, reuse")
    _model_args(p)
    p.add_argument("--json", default=None, help="write the analysis (and the vertical transform's outcome) as JSON")
    p.add_argument("--rows", type=int, default=40, help="stages to print (all are in the JSON)")

    _tune_parser(sub)

    p = sub.add_parser("zoo", help="the paper's six models, built locally with random weights")
    zsub = p.add_subparsers(dest="zoo_command", required=True)
    zsub.add_parser("list", help="list the zoo models")
    e = zsub.add_parser("export", help="write a zoo model as an ONNX file")
    e.add_argument("name", choices=zoo.names(), help="which zoo model (see `souffle-tvm zoo list`)")
    e.add_argument("--small", action="store_true", help="the small variant (same structure, fewer layers/channels)")
    e.add_argument("--dtype", default="float32", choices=["float32", "float16"],
                   help="precision of weights and activations (bert and swin also in float16)")
    e.add_argument("-o", "--output", default=None, help="file name (default NAME[-small].onnx)")
    return parser


def _add_global_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-q", "--quiet", action="store_true",
                        help="no progress line on stderr for the long steps (import, build, nvcc, feedback); "
                             "it shows on a terminal, or anywhere with SOUFFLE_TVM_PROGRESS=1")


def _add_report_parser(sub) -> None:
    p = sub.add_parser("report", help="show a saved report (compile --report) as a table and/or an HTML page",
                       description="Print the report written by `souffle-tvm compile --report FILE` as a table; "
                                   "with --html also write a self-contained page (inline CSS and SVG, no network) "
                                   "with the kernel-group graph, subprogram boundaries and why each was drawn.")
    p.add_argument("report", metavar="REPORT.json", help="a report written by `souffle-tvm compile --report`")
    p.add_argument("--html", default=None, metavar="OUT.html", help="also write the report as one HTML file")
    p.add_argument("--rows", type=int, default=40, metavar="N",
                   help="kernels to list in the terminal table (default 40; the HTML lists all)")
    p.set_defaults(handler=cmd_report)


def cmd_report(args) -> int:
    """``souffle-tvm report``: a saved Report as a table, optionally as HTML."""
    from .report import html as report_html
    from .report.schema import Report

    if args.rows < 0:
        raise SouffleError("--rows must be 0 or more")
    report = Report.load(args.report)
    print(report.table(args.rows))
    if args.html:
        _writable(args.html, "--html")
        report_html.save(report, args.html)
        print(f"\nhtml: {args.html}")
    return EXIT_OK


def _tune_parser(sub) -> None:
    p = sub.add_parser(
        "tune", help="tune every Souffle stage with MetaSchedule into a JSON database `compile --database` reuses",
        description="Tune each distinct Souffle group PrimFunc (v2 kernels, or the stages v3 stitches) with "
                    "MetaSchedule (evolutionary search, XGBoost cost model). Records go to a JSONDatabase in "
                    "--database DIR; `souffle-tvm compile --fusion souffle --database DIR` applies them. "
                    "Measuring needs the target's hardware: llvm measures on this CPU; cuda needs a local GPU "
                    "or an RPC tracker with GPU servers (exit 2 otherwise).")
    _input_args(p)
    p.add_argument("--target", default="cuda", help="cuda (default sm_90), 'cuda -arch=sm_80', or llvm")
    p.add_argument("--arch", default=None, help="CUDA architecture, e.g. sm_80 or sm_90 (default sm_90)")
    p.add_argument("--database", required=True, metavar="DIR",
                   help="work dir of the JSON database (created if missing; new records are appended)")
    p.add_argument("--trials", type=int, default=64, metavar="N",
                   help="measured candidates per distinct stage (default 64)")
    p.add_argument("--max-stages", type=int, default=None, metavar="N",
                   help="tune only the first N distinct stages (the rest keep the default rules)")
    p.add_argument("--rpc-tracker", default=None, metavar="HOST:PORT",
                   help="measure on remote GPUs registered with this TVM RPC tracker (needs --rpc-key)")
    p.add_argument("--rpc-key", default=None, metavar="KEY", help="the device key the RPC servers registered with")
    p.add_argument("--fusion-level", default="auto", choices=["auto", "v2", "v3"],
                   help="whose groups to tune: auto (default) = those of the level `compile --fusion souffle` "
                        "builds by default (its --level auto: v3 with the time-driven partitioner, for the same "
                        "target); v2 kernels; or the v3 stages (after two-phase reductions; a tuned v3 stage is "
                        "used only if its thread count is the stitched kernel's)")


def cmd_tune(args) -> int:
    from . import tune
    from .core.targets import make_target

    tune.tune(args.model, make_target(args.target, args.arch), args.database, args.trials, level=args.fusion_level,
              small=args.small, dtype=args.dtype, shapes=_parse_shapes(args.input_shapes),
              bind=parse_bind(args.bind), rpc_tracker=args.rpc_tracker, rpc_key=args.rpc_key, max_tasks=args.max_stages)
    return EXIT_OK


def cmd_zoo(args) -> int:
    import onnx

    if args.zoo_command == "list":
        for name, entry in zoo.MODELS.items():
            print(f"{name:<13} {entry.summary}  [{'/'.join(entry.dtypes)}; paper: {entry.paper_dtype}]")
        return EXIT_OK
    out = args.output or f"{args.name}{'-small' if args.small else ''}{'-fp16' if args.dtype == 'float16' else ''}.onnx"
    model = zoo.build(args.name, small=args.small, dtype=args.dtype)
    onnx.save(model, out)
    print(f"wrote {out} ({len(model.graph.node)} nodes, {os.path.getsize(out) / 1e6:.1f} MB)")
    return EXIT_OK


def cmd_analyze(args) -> int:
    import json

    from .te import analysis, program as te_program
    from .frontend.importer import import_onnx
    from .transforms import vertical

    _writable(args.json, "--json")

    m = import_onnx(args.model, _parse_shapes(args.input_shapes), small=args.small, dtype=args.dtype,
                    bind=parse_bind(args.bind))
    prog = te_program.lower(m.mod, weight_values=m.params)
    a = analysis.analyze(prog)
    print(a.table(args.rows))
    v = vertical(prog)
    after = analysis.analyze(v.program)
    print(f"\nvertical transform: {len(v.inlined)} one-to-one stages composed into their consumers; "
          f"{len(after.stages)} stages remain ({', '.join(f'{k} {n}' for k, n in sorted(after.counts().items()))})")
    survivors = {k: r for k, r in v.kept.items() if not r.startswith("reduction")}
    for name, reason in list(survivors.items())[: args.rows]:
        print(f"  kept {name}: {reason}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": m.name, **a.to_json(), "vertical": {"inlined": v.inlined, "kept": v.kept,
                       "counts_after": after.counts()}}, f, indent=1)
        print(f"analysis: {args.json}")
    return EXIT_OK


def cmd_compile(args) -> int:
    from .pipeline.driver import compile as compile_model

    _writable(args.report, "--report")
    _writable(args.output, "-o")
    t = time.perf_counter()
    compiled = compile_model(args.model, args.target, args.fusion, arch=args.arch, small=args.small,
                             dtype=args.dtype, shapes=_parse_shapes(args.input_shapes), nvcc=not args.no_nvcc,
                             level=args.level, gemm_k_tile=args.gemm_k_tile, partitioner=args.partitioner,
                             reduction=args.reduction, database=args.database, bind=parse_bind(args.bind),
                             cuda_graph=args.cuda_graph, gemm_tile=args.gemm_tile, count_traffic=args.count_traffic,
                             onchip=not args.off_chip)
    print(compiled.report.table())
    if compiled.report.counted:
        c = compiled.report.counted
        print(f"\ncounted in the emulator: {c['bytes'] / 1e6:.3f} MB distinct, {c['sector_bytes'] / 1e6:.3f} MB in "
              f"sectors; analytic bytes held: {c['analytic_held']}")
    print(f"\ntotal {time.perf_counter() - t:.1f} s (import, build, nvcc)")
    if args.report:
        compiled.report.save(args.report)
        print(f"report: {args.report}")
    if args.output:
        try:
            compiled.export_library(args.output)
        except Exception as err:  # noqa: BLE001 - TVM reports a failed link as a generic error
            raise SouffleError(f"-o {args.output}: the library could not be written: "
                               f"{str(err).strip().splitlines()[-1][:200]}") from None
        print(f"library: {args.output} (+ {args.output}.params.npz)")
    return EXIT_OK


def _load_library(path: str):
    import tvm

    meta_path = f"{path}.params.npz"
    if not os.path.exists(meta_path):
        raise SouffleError(f"{meta_path} not found: a library made by `souffle-tvm compile -o` has its weights beside it")
    meta = np.load(meta_path)
    target = str(meta["__target__"])
    if not target.startswith("llvm"):
        raise SouffleError(f"{path} was built for {target}; only llvm libraries run on this CPU "
                           "(rebuild with --target llvm)")
    from .frontend.importer import TensorInfo

    inputs = []
    for row in meta["__inputs__"]:
        name, dims, dtype = str(row).split("|")
        inputs.append(TensorInfo(name, tuple(int(d) for d in dims.split("x") if d), dtype))
    params = [meta[k] for k in sorted(k for k in meta.files if k.startswith("param_"))]
    return tvm.runtime.load_module(path), params, inputs, [str(o) for o in meta["__outputs__"]]


def cmd_run(args) -> int:
    from .runtime import runner

    _writable(args.outputs, "--outputs")
    feeds = _load_inputs(args.inputs)
    device = runner.cuda_device() if args.target == "cuda" else None    # no GPU: say so before compiling
    if device is not None and args.model.endswith(".so"):
        raise SouffleError("run --target cuda compiles the model: give the .onnx file or the zoo name")
    given = f"--inputs {args.inputs}"
    if args.model.endswith(".so"):
        if args.check:
            raise SouffleError("--check needs the ONNX model: run it on the .onnx file or the zoo name")
        executable, params, inputs, output_names = _load_library(args.model)
        if feeds is not None:
            runner.check_given({i.name: i.dtype for i in inputs}, feeds, given)
        model = None
    else:
        from .frontend.binding import bind_inputs
        from .frontend.importer import graph_inputs, input_types, load_model, shapes_from_arrays
        from .pipeline.driver import compile as compile_model

        shapes = _parse_shapes(args.input_shapes)
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
    tol = args.tolerance or runner.default_tolerance(inputs[0].dtype if inputs else "float32")
    ok = True
    for c in runner.compare(output_names, outs, ref):
        status = "ok" if c.ok(tol) else "MISMATCH"
        ok &= c.ok(tol)
        print(f"  check {c.name} vs {ref_name}: rel L2 {c.rel_l2:.3e}  max |diff| {c.max_abs:.3e}  {status}")
    return EXIT_OK if ok else EXIT_MISMATCH


def _show_warning(show):
    """Our warnings (something recovered from, e.g. a cache entry recomputed) as one
    ``souffle-tvm: note:`` line; any other warning as Python shows it."""
    def showwarning(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, SouffleWarning):
            progress.clear()
            print(f"souffle-tvm: note: {message}", file=file or sys.stderr)
        else:
            show(message, category, filename, lineno, file, line)
    return showwarning


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handlers = {"compile": cmd_compile, "run": cmd_run, "zoo": cmd_zoo, "analyze": cmd_analyze, "tune": cmd_tune}
    if not args.quiet and progress.wanted():
        progress.enable()
    with warnings.catch_warnings():
        warnings.showwarning = _show_warning(warnings.showwarning)
        return _run(handlers.get(args.command) or args.handler, args)


def _for_the_cli(err: Exception) -> str:
    """The error's message, in the CLI's terms where the library phrases it for Python
    (``shapes={...}`` is ``--input-shapes NAME:DxD`` here)."""
    if isinstance(err, DynamicShapeError) and err.dynamic:
        name, dims = next(iter(err.dynamic.items()))
        i = next(i for i, d in enumerate(dims) if isinstance(d, str))
        forms = ",".join(f"{n}:{'x'.join('D' if isinstance(d, str) else str(d) for d in ds)}"
                         for n, ds in err.dynamic.items())
        return (f"input {name!r} has a dynamic dimension {i} ({dims[i]!r}); souffle-tvm compiles static shapes "
                f"only: give {'its shape' if len(err.dynamic) == 1 else 'their shapes'} with --input-shapes "
                f"{forms} (each D a size of 1 or more), or export the model with fixed sizes")
    if isinstance(err, UnknownInputError) and err.names:
        one = len(err.names) == 1
        return (f"--input-shapes: {', '.join(map(repr, err.names))} {'is not an input' if one else 'are not inputs'} "
                f"of the model; its inputs are: {', '.join(err.inputs) or 'none'}")
    return str(err)


def _run(handler, args) -> int:
    try:
        return handler(args)
    except MiscompileError as err:
        # TVM's bug, not the input: one line, but the exit code of an internal error
        progress.clear()
        print(f"souffle-tvm: error: {' '.join(str(err).split())}", file=sys.stderr)
        return EXIT_INTERNAL
    except (SouffleError, OSError, ValueError, KeyError) as err:
        # Bad input: a missing file, an unknown target, a malformed model. One line, no traceback.
        progress.clear()
        # one line, whatever the message held (some libraries' messages run over several)
        print(f"souffle-tvm: error: {' '.join(_for_the_cli(err).split())}", file=sys.stderr)
        return EXIT_INPUT
    except KeyboardInterrupt:
        return 130
    except Exception:  # noqa: BLE001 - anything else is our bug; keep the traceback for the report
        import traceback

        progress.clear()
        traceback.print_exc()
        print("souffle-tvm: internal error (a bug: please report it with the traceback above)", file=sys.stderr)
        return EXIT_INTERNAL
    finally:
        progress.disable()


if __name__ == "__main__":
    sys.exit(main())
