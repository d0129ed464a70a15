"""``souffle-tvm``: compile, run and inspect models, in the manner of the former ``tvmc``.

Exit codes: 0 success; 1 ``run --check`` found a numerical mismatch; 2 bad input or an
unavailable feature (the message says which); 3 an internal error (a bug: please report).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

from ..core import progress
from .. import zoo
from ..errors import DynamicShapeError, MiscompileError, SouffleError, SouffleWarning, UnknownInputError
from ..frontend.binding import parse_bind
from .options import (EXIT_INPUT, EXIT_INTERNAL, EXIT_OK, Parser, input_args, model_args, parse_shapes, positive,
                      whole, writable)
from . import fit
from .run import cmd_run


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="souffle-tvm", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="exit codes: 0 ok, 1 numerical mismatch, 2 bad input, 3 internal error")
    _add_global_flags(parser)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_report_parser(sub)

    p = sub.add_parser("compile", help="build a model and write its report")
    model_args(p)
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
    p.add_argument("--waves", action="store_true",
                   help="--level v3/v4 on CUDA: a stacked recurrence (LSTM, GRU) as a wavefront, cell (l, t) "
                        "beside (l-1, t+1) behind one barrier a wave; deep stacks whose waves do not roll keep "
                        "the layer order")
    p.add_argument("--count-traffic", action="store_true",
                   help="CUDA: run the built kernels in the GPU emulator (on the CPU) and report the traffic they "
                        "execute beside the analytic bytes: distinct bytes, 32-byte sectors per warp request "
                        "(coalescing), shared-memory accesses (small models: it takes seconds to minutes)")
    p.add_argument("--database", default=None, metavar="DIR",
                   help="--fusion souffle: apply the tuned schedules `souffle-tvm tune` wrote to DIR "
                        "(stages it does not hold keep the default rules; the report says which)")
    p.add_argument("--measure", action=argparse.BooleanOptionalAction, default=None,
                   help="--fusion souffle --level auto: time the candidate builds (Souffle's, TVM's, the budget "
                        "v3) on the device and keep the measured fastest that matches onnxruntime; the default "
                        "measures where a GPU is reachable (a local one, or --rpc-tracker); --measure asks for "
                        "it (on llvm: this CPU); --no-measure never measures. Times go to a timing cache per "
                        "device in $SOUFFLE_TVM_CACHE/timing")
    p.add_argument("--rpc-tracker", default=None, metavar="HOST:PORT",
                   help="measure on a device registered with this TVM RPC tracker (needs --rpc-key)")
    p.add_argument("--rpc-key", default=None, metavar="KEY", help="the device key the RPC server registered with")

    p = sub.add_parser("run", help="run a model on the CPU (llvm) and optionally check it against onnxruntime")
    model_args(p)
    p.add_argument("--inputs", default=None, help=".npz with one array per model input (default: seeded random)")
    p.add_argument("--outputs", default=None, help="save the outputs to this .npz")
    p.add_argument("--check", action="store_true", help="compare with onnxruntime (exit 1 on mismatch)")
    p.add_argument("--tolerance", type=positive, default=None, help="relative L2 tolerance (1e-5 fp32, 1e-2 fp16)")
    p.add_argument("--seed", type=whole(0), default=0, help="seed of the random inputs")
    p.add_argument("--target", default="llvm", choices=["llvm", "cuda"],
                   help="where to run: this CPU (default) or the first CUDA GPU (needs one and TVM's CUDA runtime)")
    p.add_argument("--time", type=whole(1), default=None, metavar="N",
                   help="also print the median time of N runs after a warm-up (synchronised with the device)")

    p = sub.add_parser("analyze", help="the whole model as tensor expressions: stage kinds, index maps, reuse")
    model_args(p)
    p.add_argument("--json", default=None, help="write the analysis (and the vertical transform's outcome) as JSON")
    p.add_argument("--rows", type=whole(0), default=40, help="stages to print (all are in the JSON)")

    _tune_parser(sub)
    fit.add_parser(sub)

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
    p.add_argument("--rows", type=whole(0), default=40, metavar="N",
                   help="kernels to list in the terminal table (default 40; the HTML lists all)")
    p.set_defaults(handler=cmd_report)


def cmd_report(args) -> int:
    """``souffle-tvm report``: a saved Report as a table, optionally as HTML."""
    from ..report import html as report_html
    from ..report.schema import Report

    if args.rows < 0:
        raise SouffleError("--rows must be 0 or more")
    report = Report.load(args.report)
    print(report.table(args.rows))
    if args.html:
        writable(args.html, "--html")
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
    input_args(p)
    p.add_argument("--target", default="cuda", help="cuda (default sm_90), 'cuda -arch=sm_80', or llvm")
    p.add_argument("--arch", default=None, help="CUDA architecture, e.g. sm_80 or sm_90 (default sm_90)")
    p.add_argument("--database", required=True, metavar="DIR",
                   help="work dir of the JSON database (created if missing; new records are appended)")
    p.add_argument("--trials", type=whole(1), default=64, metavar="N",
                   help="measured candidates per distinct stage (default 64)")
    p.add_argument("--max-stages", type=whole(1), default=None, metavar="N",
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
    from .. import tune
    from ..core.targets import make_target

    tune.tune(args.model, make_target(args.target, args.arch), args.database, args.trials, level=args.fusion_level,
              small=args.small, dtype=args.dtype, shapes=parse_shapes(args.input_shapes),
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

    from ..te import analysis, program as te_program
    from ..frontend.importer import import_onnx
    from ..transforms import vertical

    writable(args.json, "--json")

    m = import_onnx(args.model, parse_shapes(args.input_shapes), small=args.small, dtype=args.dtype,
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
    from ..pipeline.driver import compile as compile_model

    writable(args.report, "--report")
    writable(args.output, "-o")
    t = time.perf_counter()
    compiled = compile_model(args.model, args.target, args.fusion, arch=args.arch, small=args.small,
                             dtype=args.dtype, shapes=parse_shapes(args.input_shapes), nvcc=not args.no_nvcc,
                             level=args.level, gemm_k_tile=args.gemm_k_tile, partitioner=args.partitioner,
                             reduction=args.reduction, database=args.database, bind=parse_bind(args.bind),
                             cuda_graph=args.cuda_graph, gemm_tile=args.gemm_tile, count_traffic=args.count_traffic,
                             onchip=not args.off_chip, measure=args.measure, rpc_tracker=args.rpc_tracker,
                             rpc_key=args.rpc_key, waves=args.waves)
    print(compiled.report.table())
    if compiled.report.counted:
        c = compiled.report.counted
        print(f"\ncounted in the emulator: {c['bytes'] / 1e6:.3f} MB distinct, {c['sector_bytes'] / 1e6:.3f} MB in "
              f"sectors; analytic bytes held: {c['analytic_held']}")
    print("\n" + _timed_line(compiled.report))
    print(f"total {time.perf_counter() - t:.1f} s (import, build, nvcc)")
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


def _timed_line(report) -> str:
    """One line: what this compile measured on a device, or that its times are only predicted."""
    m = report.measured
    if m:
        kept = next(c for c in m["candidates"] if c["name"] == m["chosen"])
        return f"measured on {m['where']}: kept {m['chosen']}, {kept['ms']:.4f} ms an inference (median)"
    if report.latency:
        return (f"not measured: {report.latency['graph_ms']:.3f} ms is the latency model's prediction (no GPU was "
                "reached; --measure or --rpc-tracker HOST:PORT --rpc-key KEY times the candidates)")
    return "not measured (on llvm, --fusion souffle --measure times the candidates on this CPU)"


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


