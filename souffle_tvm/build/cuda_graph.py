"""TVM's CUDA-graph rewriting (``relax.backend.use_cuda_graph``) for either fusion, and what it
captured: the baseline a TVM user would choose (separate kernels replayed from graphs).

``RewriteCUDAGraph`` captures the kernels whose buffers are static: weights count as static
because ``main`` carries ``num_input`` (the importer and the Souffle emitter set it), the
per-call inputs and the outputs do not. Kernels reading an input or writing an output stay
launches of their own; the summary counts both, read from the VM's own listing.
"""

from __future__ import annotations

import contextlib
import re

import tvm
from tvm import relax

CONFIG_KEY = "relax.backend.use_cuda_graph"
_CALL = re.compile(r"^\s+call\s+(\S+)\s")
_CAPTURED = re.compile(r"f\[(\w+)\]")
REPLAY = "vm.builtin.cuda_graph.run_or_capture"


@contextlib.contextmanager
def enabled(on: bool):
    """Build under TVM's CUDA-graph rewriting when ``on`` (the current opt level kept)."""
    if not on:
        yield
        return
    current = tvm.transform.PassContext.current()
    config = dict(current.config) | {CONFIG_KEY: True}
    with tvm.transform.PassContext(opt_level=current.opt_level, config=config):
        yield


def summary(ex: relax.Executable, kernels: set[str]) -> dict:
    """Per inference: graph replays, kernel launches inside the replayed graphs, launches outside.

    ``main`` replays a capture function per ``run_or_capture`` (one function may serve several
    replays, e.g. the same weight transpose for four experts); each replay launches that
    function's kernels.
    """
    calls: dict[str, list[str]] = {}
    function = None
    for line in ex.as_text().splitlines():
        if line.startswith("@"):
            function = line[1:].split()[0].rstrip(":")
            continue
        m = _CALL.match(line)
        if m and function is not None:
            target = _CAPTURED.search(line) if m.group(1) == REPLAY else None
            calls.setdefault(function, []).append(f"replay:{target.group(1)}" if target else m.group(1))
    main = calls.get("main", [])
    replayed = [c.split(":", 1)[1] for c in main if c.startswith("replay:")]
    outside: dict[str, int] = {}
    for c in main:
        if c in kernels:
            outside[c] = outside.get(c, 0) + 1
    return {"replays": len(replayed),
            "captured_launches": sum(1 for f in replayed for c in calls.get(f, []) if c in kernels),
            "launches_outside": sum(outside.values()), "outside_by_function": outside}
