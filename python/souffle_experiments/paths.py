"""Where the repository is, for experiments that read or write ``results/``, ``docs/`` or ``tests/``.

These experiments run from a checkout of the repository: ``pip install -e .`` installs
``souffle_experiments`` in place (``python/souffle_experiments``), so ``ROOT`` below is the
checkout this package lies in, whichever directory a command is started from. A copy installed
elsewhere (a wheel) has no repository beside it; nothing here supports that.

Imports nothing but the standard library: the GPU check (``gpu_check``) runs this package on a
machine with TVM's runtime alone, ``souffle_tvm`` found in the same checkout.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

PACKAGE = Path(__file__).resolve().parent       # python/souffle_experiments
ROOT = PACKAGE.parent.parent                    # the checkout: results/, tests/, docs/, souffle_tvm/
RESULTS = ROOT / "results"          # the dated record (history)
DATA = ROOT / "data"                # what the code and the tests read (versioned inputs)


def checkout_module(relative: str, name: str | None = None) -> ModuleType:
    """A Python file of the checkout that is no package's module (``tests/torch_models.py``),
    imported by its path (once; later calls return the same module) without touching ``sys.path``."""
    path = ROOT / relative
    name = name or path.stem
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module          # before it runs: dataclasses look their module up
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def child_env(env: dict | None = None) -> dict:
    """The environment for a child ``python -m souffle_experiments...``: this package's folder
    (``python/``) and the folder the running ``souffle_tvm`` came from first on ``PYTHONPATH``, so
    the child imports what this process imports, installed or not (the GPU machine runs the
    checkout with ``PYTHONPATH=python``)."""
    env = dict(os.environ if env is None else env)
    first = [str(PACKAGE.parent)]
    souffle = sys.modules.get("souffle_tvm")
    if souffle is not None and getattr(souffle, "__file__", None):
        first.append(str(Path(souffle.__file__).resolve().parent.parent))
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in first]
    env["PYTHONPATH"] = os.pathsep.join(first + rest)
    return env
