"""What the CLI reads from its user before any work: the model and input arguments every command
shares, ``--input-shapes``, ``--inputs`` files, paths an option will write; and its exit codes."""

from __future__ import annotations

import argparse
import math
import os
import zipfile

import numpy as np

from ..errors import SouffleError

EXIT_OK, EXIT_MISMATCH, EXIT_INPUT, EXIT_INTERNAL = 0, 1, 2, 3


class Parser(argparse.ArgumentParser):
    """argparse, with its errors in the CLI's form: exit 2 and one line (no usage block), the
    command's ``--help`` named for the rest."""

    def error(self, message: str):
        self.exit(2, f"souffle-tvm: error: {message} (see `{self.prog} --help`)\n")


def whole(least: int):
    """An argparse type: a whole number of at least ``least`` (``Parser`` then exits 2 with one
    ``error:`` line naming the option)."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if n < least:
            raise argparse.ArgumentTypeError(f"{n} is too small: give {least} or more")
        return n
    parse.__name__ = f"whole number of at least {least}"
    return parse


def positive(text: str) -> float:
    """An argparse type: a finite number above 0."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(x) and x > 0):
        raise argparse.ArgumentTypeError(f"{text} must be a finite number above 0")
    return x


def input_args(p: argparse.ArgumentParser) -> None:
    """Which model, at which size, precision and input shapes (every command that imports one)."""
    p.add_argument("model", help="an ONNX file, or a zoo model name (see `souffle-tvm zoo list`)")
    p.add_argument("--small", action="store_true", help="zoo models: the small variant (same structure)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                   help="what the model computes in: a float32 model (an ONNX file, or a zoo model not built in "
                        "that type) is converted, its weights stored in the type, its inputs and outputs kept "
                        "float32, softmax, norms and reductions computed in float32 (bert and swin are also "
                        "built natively in float16)")
    p.add_argument("--input-shapes", default=None, metavar="NAME:1x128,...",
                   help="fix the shapes of dynamic model inputs")
    p.add_argument("--bind", action="append", default=None, metavar="NAME=VALUE",
                   help="fix a model input to a value at compile time (a number, true/false, or an "
                        "array.npy), e.g. a configuration input an If branches on; repeatable")


def model_args(p: argparse.ArgumentParser) -> None:
    input_args(p)
    p.add_argument("--fusion", default="tvm", choices=["tvm", "souffle"],
                   help="kernel fusion: tvm (default) = TVM's rule-based FuseOps, or souffle = Souffle's "
                        "global-analysis pipeline (its level: --level)")
    p.add_argument("--level", default="auto",
                   help="souffle pipeline level: auto (default) = v3 with the time-driven partitioner, and on "
                        "CUDA TVM's own build instead where the latency model predicts it faster; "
                        "v0 no transforms, v1 + horizontal, v2 + vertical, "
                        "v3 + two-phase reductions and stitched cooperative kernels, "
                        "v4 + L2 prefetch of each stitched kernel's next-segment inputs")
    p.add_argument("--gemm-k-tile", type=whole(1), default=None, metavar="N",
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


def parse_shapes(text: str | None) -> dict | None:
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


def writable(path: str | None, option: str) -> None:
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


def load_inputs(path: str | None) -> dict | None:
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
