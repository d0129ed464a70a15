"""The package's shape: imports point one way, no circles, no module past 450 lines.

The layer order is written once, here (docs/architecture.md explains it): a module may import
from its own layer's package and from the layers before it, never from a later one. Every
import counts, those inside functions too.
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "souffle_tvm"

# Lowest first. ``errors`` is the vocabulary of failures every layer raises; the package's
# own ``__init__`` (the lazy public face) sits on top.
LAYERS = [
    ("errors",),
    ("core", "zoo"),
    ("cost",),
    ("frontend",),
    ("te",),
    ("transforms",),
    ("partition",),
    ("codegen",),
    ("stitch",),
    ("build",),
    ("runtime",),
    ("planning",),
    ("report",),
    ("measure",),
    ("pipeline",),
    ("transform",),
    ("tune",),
    ("cli",),
    ("",),
]
MAX_LINES = 450
WITHOUT_TVM = ("souffle_tvm.zoo", "souffle_tvm.runtime.numerics", "souffle_tvm.runtime.standalone")


@functools.cache
def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(["souffle_tvm", *parts])] = path
    return out


@functools.cache
def _sources() -> dict[str, tuple[str, bool]]:
    """module -> (its source, whether it is a package's ``__init__``): what the checks read."""
    return {m: (p.read_text(), p.name == "__init__.py") for m, p in _modules().items()}


def _package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _layer(module: str) -> int:
    top = _package_of(module)
    return next(i for i, names in enumerate(LAYERS) if top in names)


def _resolve(module: str, is_pkg: bool, node: ast.ImportFrom, modules=None) -> list[str]:
    if node.level == 0:
        base = node.module or ""
    else:
        parts = module.split(".") if is_pkg else module.split(".")[:-1]
        parts = parts[:len(parts) - (node.level - 1)]
        base = ".".join(parts + ([node.module] if node.module else []))
    subs = [f"{base}.{a.name}" for a in node.names]
    # ``from pkg import submodule`` depends on the submodule (pkg's __init__ runs as its parent)
    return subs if base and all(s in (modules or _modules()) for s in subs) else [base] + subs


def _imports(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """module -> the package modules it imports (anywhere in its body). Importing a module runs
    its packages' ``__init__``s first, which is no edge of its own; an import that names the
    root package itself (``import souffle_tvm``, ``from souffle_tvm import compile``) is one: the
    root's lazy public face reaches the whole pipeline."""
    graph = {}
    for module, (source, is_pkg) in sources.items():
        found = set()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = _resolve(module, is_pkg, node, sources)
            else:
                continue
            ancestors = {".".join(module.split(".")[:i]) for i in range(2, module.count(".") + 1)}
            found.update(n for n in names if n in sources and n != module and n not in ancestors)
        graph[module] = found
    return graph


def _upward(sources: dict[str, tuple[str, bool]]) -> list[str]:
    """The imports that point up (or sideways) the layers."""
    wrong = []
    for module, deps in _imports(sources).items():
        for dep in deps:
            same_package = _package_of(dep) == _package_of(module)
            if _layer(dep) > _layer(module) or (_layer(dep) == _layer(module) and not same_package):
                wrong.append(f"{module} imports {dep}")
    return sorted(wrong)


def _circles(sources: dict[str, tuple[str, bool]]) -> list[list[str]]:
    """Import circles: strongly connected components of two or more modules (Tarjan's)."""
    graph = _imports(sources)
    index, low, stack, on, circles, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return circles


def _known(node, scope: dict) -> tuple[str, bool]:
    """(the text an import_module argument is known to start with, whether that is all of it):
    literals, f-strings and concatenations, names bound to literals in ``scope`` read through."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value, True
    if isinstance(node, ast.Name):
        return scope.get(node.id, ""), node.id in scope
    if isinstance(node, ast.FormattedValue):
        return _known(node.value, scope)
    parts = (node.values if isinstance(node, ast.JoinedStr)
             else [node.left, node.right] if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) else None)
    if parts is None:
        return "", False
    text = ""
    for part in parts:
        known, whole = _known(part, scope)
        text += known
        if not whole:
            return text, False
    return text, True


def _dynamic(sources: dict[str, tuple[str, bool]]) -> list[str]:
    """``importlib.import_module``/``__import__`` calls that could hide an edge from the checks:
    every one whose top package is not known (a literal, or an f-string whose known start names
    it, names bound to literals in the same function or module read through) to be another."""
    hidden = []
    for module, (source, _) in sources.items():
        tree = ast.parse(source)
        for scope_node in [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
            scope = {}
            for n in ast.walk(scope_node):
                if (isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)
                        and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)):
                    scope[n.targets[0].id] = n.value.value
            calls = [n for n in ast.walk(scope_node) if isinstance(n, ast.Call)]
            for node in calls:
                fn = node.func
                name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
                if name not in ("import_module", "__import__") or not node.args:
                    continue
                # the module's top package must be known, and not this one
                text, whole = _known(node.args[0], scope)
                top = text.split(".")[0] if whole or "." in text else ""
                if not top or top.startswith("souffle"):
                    hidden.append(f"{module}: {name}({ast.unparse(node.args[0])})")
    return sorted(set(hidden))


def test_every_package_module_has_a_layer():
    unknown = sorted(m for m in _modules() if not any(_package_of(m) in names for names in LAYERS))
    assert not unknown, f"add these to LAYERS (and docs/architecture.md): {unknown}"


def test_imports_point_down_the_layers():
    wrong = _upward(_sources())
    assert not wrong, "imports that point up (or sideways) the layers:\n" + "\n".join(wrong)


def test_no_import_circle():
    circles = _circles(_sources())
    assert not circles, f"import circles: {circles}"


def test_no_dynamic_import_of_our_own_modules():
    """``importlib.import_module``/``__import__`` would hide an edge from the tests above: only
    modules outside this package (TVM's), named by literals, may be imported that way."""
    hidden = _dynamic(_sources())
    assert not hidden, hidden


def test_no_module_is_longer_than_the_limit():
    long = {m: n for m, p in _modules().items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for dep in graph.get(todo.pop(), ()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_the_feedback_loop_never_reads_a_report():
    """The ptxas loop prices the build's facts; the report is rendered once, by the driver, at
    the end: nothing the loop and the build import reaches ``report``."""
    graph = _imports(_sources())
    for module in ("souffle_tvm.pipeline.feedback", "souffle_tvm.pipeline.building"):
        assert module in graph
        reached = _reach(graph, module)
        assert "souffle_tvm.build.facts" in reached
        assert not [m for m in reached if _package_of(m) == "report"], (module, sorted(reached))


def test_runtime_side_imports_without_tvm():
    """The GPU machine runs the check with TVM's runtime alone: these must not need the compiler."""
    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in ('tvm', 'tvm_ffi'):\n"
            "            raise ImportError(f'{name} is blocked')\n"
            "sys.meta_path.insert(0, Block())\n"
            + "".join(f"import {m}\n" for m in WITHOUT_TVM) +
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


PLANTED = "souffle_tvm.core.planted"


def _with(source: str, name: str = PLANTED, **more: str) -> dict[str, tuple[str, bool]]:
    """The package's sources with ``name`` (a module of the lowest layers) holding ``source``."""
    return {**_sources(), name: (source, False), **{m: (src, False) for m, src in more.items()}}


def test_the_checks_find_planted_faults():
    """Each check run whole on the package with one fault planted in a low layer (they could
    pass by reading nothing): the real package passes them, the planted one does not."""
    assert _upward(_sources()) == [] and _circles(_sources()) == [] and _dynamic(_sources()) == []
    ups = {
        "def f():\n    from ..pipeline import driver\n": "souffle_tvm.pipeline.driver",
        "import souffle_tvm\n": "souffle_tvm",
        "from souffle_tvm import compile\n": "souffle_tvm",
        "from .. import cli\n": "souffle_tvm.cli",
    }
    for source, dep in ups.items():
        assert _upward(_with(source)) == [f"{PLANTED} imports {dep}"], source
    two = "souffle_tvm.core.planted_b"
    assert _circles(_with("from . import planted_b\n", **{two: "from . import planted\n"})) == [[PLANTED, two]]
    for source in ("import importlib\ndef f(name):\n    return importlib.import_module(name)\n",
                   "import importlib\nimportlib.import_module('souffle_tvm.cli')\n",
                   "def f():\n    base = '.'\n    return __import__(f'{base}pipeline')\n"):
        assert len(_dynamic(_with(source))) == 1, source
    ok = "import importlib\ndef f():\n    name = 'tvm.s_tir'\n    return importlib.import_module(f'{name}.x')\n"
    assert _dynamic(_with(ok)) == []
