"""The experiments package (python/souffle_experiments): one entry point whose commands reach every
module, the GPU check importable where TVM's compiler is not, and the runner's cells, rows and files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from souffle_experiments import runner
from souffle_experiments.__main__ import COMMANDS, usage
from souffle_experiments.paths import PACKAGE, ROOT

NOT_COMMANDS = {"__init__", "__main__", "paths", "runner"}


def test_every_module_is_a_command_and_help_lists_each_once():
    modules = {p.stem for p in PACKAGE.glob("*.py")} - NOT_COMMANDS
    assert sorted(m for m, _ in COMMANDS.values()) == sorted(modules)
    text = usage()
    for name in COMMANDS:
        assert sum(line.split()[0] == name for line in text.splitlines() if line.startswith("  ")) == 1


def test_help_runs_from_any_directory(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "souffle_experiments", "--help"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "gpu-check" in proc.stdout, proc.stderr
    assert ROOT == Path(__file__).resolve().parent.parent      # the checkout the experiments run from


def test_gpu_check_imports_without_the_tvm_compiler_or_the_installed_package(tmp_path):
    # what the GPU machine has: the checkout, PYTHONPATH=python, no TVM (only its runtime)
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent("""
        import sys
        sys.meta_path[:] = [f for f in sys.meta_path if "Editable" not in getattr(f, "__name__", "")]

        class NoTVM:
            @staticmethod
            def find_spec(name, path=None, target=None):
                if name == "tvm" or name.startswith("tvm."):
                    raise ImportError("no TVM here")

        sys.meta_path.insert(0, NoTVM)
    """))
    code = ("import sys; assert not any('Editable' in getattr(f, '__name__', '') for f in sys.meta_path); "
            "from souffle_experiments import gpu_check, microbench; "
            "assert gpu_check.__file__.startswith(sys.argv[1]), gpu_check.__file__; "
            "assert 'tvm' not in sys.modules, 'the GPU check imported the compiler'")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT / "python")])}
    proc = subprocess.run([sys.executable, "-c", code, str(PACKAGE)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def _spec(calls: list) -> runner.Spec:
    def build(model, options, cell):
        calls.append((cell.model, cell.build))
        return {"value": model * options}

    def plot(rows, path):
        plt = runner.pyplot()
        fig, ax = plt.subplots()
        ax.bar(list(rows), [r["b"] for r in rows.values()])
        fig.savefig(path)

    return runner.Spec("toy", {"a": 1, "b": 10}, rows=lambda cells: {m: {b: c["value"] for b, c in bc.items()}
                                                                     for m, bc in cells.items()},
                       build=build, table=lambda rows: runner.markdown(["model", "a", "b"],
                                                                       [[m, r["a"], r["b"]] for m, r in rows.items()]),
                       table_file="table.md", plot=plot, plot_file="toy.png", rows_file="rows.json")


def test_runner_builds_missing_cells_only_and_writes_rows_table_and_plot(tmp_path):
    calls: list = []
    store = runner.JsonCells(tmp_path / "cells.json")
    rows = runner.run(_spec(calls), tmp_path, {"x": 2, "y": 3}, store, build_only=["x"])
    assert calls == [("x", "a"), ("x", "b")] and rows == {"x": {"a": 2, "b": 20}}
    calls.clear()
    rows = runner.run(_spec(calls), tmp_path, {"x": 2, "y": 3}, runner.JsonCells(tmp_path / "cells.json"))
    assert calls == [("y", "a"), ("y", "b")]                   # x's cells came from the file
    assert json.loads((tmp_path / "rows.json").read_text()) == rows == {"x": {"a": 2, "b": 20}, "y": {"a": 3, "b": 30}}
    assert (tmp_path / "table.md").read_text() == "| model | a | b |\n| --- | --- | --- |\n| x | 2 | 20 |\n| y | 3 | 30 |\n"
    assert (tmp_path / "toy.png").read_bytes()[:4] == b"\x89PNG"
    flat = runner.JsonCells(tmp_path / "flat.json", "flat")
    runner.run(_spec([]), tmp_path / "f", {"m (small)": 1}, flat)
    assert list(json.loads((tmp_path / "flat.json").read_text())) == ["m (small) | a", "m (small) | b"]


def test_runner_tabulates_report_files_made_elsewhere(tmp_path):
    for build, model in (("a", "x"), ("b", "x"), ("a", "y"), ("c", "y")):
        (tmp_path / f"{build}_{model}.json").write_text(json.dumps({"value": f"{build}{model}"}))
    spec = runner.Spec("files", {"a": None, "b": None}, rows=lambda cells: cells)
    rows = runner.run(spec, tmp_path, store=runner.ReportFiles(tmp_path))
    assert rows == {"x": {"a": {"value": "ax"}, "b": {"value": "bx"}}, "y": {"a": {"value": "ay"}}}
