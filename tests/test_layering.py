"""The package's shape: imports point one way, no circles, no module past 500 lines.

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
    ("frontend",),
    ("te",),
    ("transforms",),
    ("partition",),
    ("codegen",),
    ("stitch",),
    ("build",),
    ("runtime",),
    ("report",),
    ("pipeline",),
    ("tune",),
    ("cli",),
    ("",),
]
MAX_LINES = 500
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


def _package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _layer(module: str) -> int:
    top = _package_of(module)
    return next(i for i, names in enumerate(LAYERS) if top in names)


def _resolve(module: str, is_pkg: bool, node: ast.ImportFrom) -> list[str]:
    if node.level == 0:
        base = node.module or ""
    else:
        parts = module.split(".") if is_pkg else module.split(".")[:-1]
        parts = parts[:len(parts) - (node.level - 1)]
        base = ".".join(parts + ([node.module] if node.module else []))
    subs = [f"{base}.{a.name}" for a in node.names]
    # ``from pkg import submodule`` depends on the submodule (pkg's __init__ runs as its parent)
    return subs if base and all(s in _modules() for s in subs) else [base] + subs


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the package modules it imports (anywhere in its body)."""
    graph = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text())
        is_pkg = path.name == "__init__.py"
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = _resolve(module, is_pkg, node)
            else:
                continue
            ancestors = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)}
            found.update(n for n in names if n in modules and n != module and n not in ancestors)
        graph[module] = found
    return graph


def test_every_package_module_has_a_layer():
    unknown = sorted(m for m in _modules() if not any(_package_of(m) in names for names in LAYERS))
    assert not unknown, f"add these to LAYERS (and docs/architecture.md): {unknown}"


def test_imports_point_down_the_layers():
    modules = _modules()
    wrong = []
    for module, deps in _imports(modules).items():
        for dep in deps:
            same_package = _package_of(dep) == _package_of(module)
            if _layer(dep) > _layer(module) or (_layer(dep) == _layer(module) and not same_package):
                wrong.append(f"{module} imports {dep}")
    assert not wrong, "imports that point up (or sideways) the layers:\n" + "\n".join(sorted(wrong))


def test_no_import_circle():
    graph = _imports(_modules())
    # Tarjan's strongly connected components: any component of two or more is a circle.
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
    assert not circles, f"import circles: {circles}"


def test_no_dynamic_import_of_our_own_modules():
    """``importlib.import_module``/``__import__`` would hide an edge from the tests above: only
    third-party modules (TVM's) may be imported that way."""
    hidden = []
    for module, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            if name not in ("import_module", "__import__") or not node.args:
                continue
            arg = ast.unparse(node.args[0])
            if "souffle" in arg or arg.strip("'\"f").startswith(".") or "__name__" in arg or "__package__" in arg:
                hidden.append(f"{module}: {name}({arg})")
    assert not hidden, hidden


def test_no_module_is_longer_than_the_limit():
    long = {m: n for m, p in _modules().items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


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


def test_the_checker_sees_a_planted_upward_import(tmp_path):
    """The checks above could pass by reading nothing: plant an upward, function-level import."""
    module = "souffle_tvm.core.planted"
    tree = ast.parse("def f():\n    from ..pipeline import driver\n")
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom))
    resolved = _resolve(module, False, node)
    assert "souffle_tvm.pipeline.driver" in resolved
    assert _layer("souffle_tvm.pipeline.driver") > _layer(module)
