"""``python -m souffle_experiments COMMAND [ARGS]``: every experiment behind one entry point.

Each command imports only its own module and hands it the rest of the command line
(``main(argv)``); ``COMMAND --help`` gives that module's options. A module's name (``gpu_check``)
is accepted too. The GPU check runs from a checkout without this package installed::

    PYTHONPATH=python python3 -m souffle_experiments gpu-check run --bundle DIR
"""

from __future__ import annotations

import importlib
import sys

# command: (module, one line for --help). Kept here, not read from the modules' docstrings, so
# that --help imports nothing (most modules import TVM's compiler).
COMMANDS: dict[str, tuple[str, str]] = {
    "bench": ("bench", "`make bench`: compile matrix TVM + V0-V4, estimates, CPU side by side (results/bench-<date>)"),
    "bench-plots": ("bench_plots", "re-draw the PNG plots of a bench.json"),
    "bench-plausibility": ("bench_plausibility", "re-pricing and fraction-of-peak check of a bench.json"),
    "bench-traffic-compare": ("bench_traffic_compare", "the traffic columns of two bench.json side by side"),
    "bench-tune": ("bench_tune", "default vs MetaSchedule-tuned stages on the CPU (llvm)"),
    "compile-time": ("compile_time", "compile time of the default against --fusion tvm, per zoo model (runner spec)"),
    "constant-sets": ("constant_sets", "saved reports priced under the fitted and every leave-one-model-out constant set"),
    "conformance": ("onnx_conformance", "ONNX's conformance suite (BackendTest) on llvm, both fusions"),
    "estimate-error": ("estimate_error", "the static resource estimate against ptxas, per stitched kernel"),
    "fetch-counted": ("fetch_counted", "counted traffic of the default build at this checkout (runner spec)"),
    "fit": ("latency_fit", "fit the latency model's constants on the measured GPU runs and validate"),
    "gpu-check": ("gpu_check", "the GPU check: prepare a bundle here, run it on a lent GPU, record"),
    "gpu-summary": ("gpu_summary", "Markdown tables and a plot of GPU-check results"),
    "import-matrix": ("import_matrix", "PyTorch exports x small models imported, built and compared"),
    "k-tile-counted": ("k_tile_counted", "counted traffic before/after the K tile choice (runner spec)"),
    "k-tile-results": ("k_tile_results", "the K tile chosen vs dlight's 16, full-size zoo (runner spec)"),
    "l2-residency": ("l2_residency", "bounds of what L2 residency could change in the latency model"),
    "latency-counts": ("latency_counts", "block counts of the replayed plans' kernels"),
    "lstm-layer-counted": ("lstm_layer_counted", "one full-size LSTM layer counted in the emulator (runner spec)"),
    "microbench": ("microbench", "per-kernel microbenchmarks: forms, prepare the bundle, run it on a GPU"),
    "onnx-models-cuda": ("onnx_models_cuda", "the conformance suite's model tests built for CUDA with nvcc"),
    "replay": ("latency_replay", "rebuild the measured builds at their commit: kernel plans"),
    "results-index": ("results_index", "results/README.md: the dated record's index (date, commit, command, finding)"),
    "resident-results": ("resident_results", "table and plot of a folder of reports by preset (runner spec)"),
    "row-chain-results": ("row_chain_results", "table and plot of the row-chain reports (runner spec)"),
    "snapshot": ("behaviour_snapshot", "snapshot what the compiler decides; --compare two (make snapshot)"),
    "sweep": ("cuda_compile_sweep", "the conformance suite's models compiled for CUDA, optionally emulated"),
    "waves-table": ("waves_table", "stacked recurrences at v3 with and without waves: kernels, grid syncs, code"),
    "traffic": ("traffic_counted", "counted traffic against the analytic bytes, small zoo (runner spec)"),
}
MODULES = {module: command for command, (module, _) in COMMANDS.items()}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: python -m souffle_experiments COMMAND [ARGS ...]", "",
             "souffle-tvm's experiments (run from a checkout; COMMAND --help for its options).", "", "commands:"]
    lines += [f"  {name:<{width}}  {line}" for name, (_, line) in sorted(COMMANDS.items())]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    command = name if name in COMMANDS else MODULES.get(name)
    if command is None:
        print(f"unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"{__package__ or 'souffle_experiments'}.{COMMANDS[command][0]}")
    sys.argv = [f"python -m souffle_experiments {command}", *rest]     # argparse's prog in --help
    return module.main(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
