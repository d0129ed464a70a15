"""One experiment runner: models x builds -> one cell each -> rows -> a Markdown table and a plot.

An experiment is a ``Spec``: the builds to make (label -> options), a ``build`` function that
makes one cell (a model under one build's options; a JSON-able dict, such as a compile report),
``rows`` (every cell -> the rows the table and plot show), ``table`` and ``plot``. ``run`` walks
the models in order and, for each, the builds in order; builds the cells its ``store`` does not
hold yet (so a run cut short resumes, and a folder of reports made elsewhere can be tabulated
without building at all), then writes into the output folder what the spec names: the rows as
JSON, the table as Markdown (printed too), the plot as a PNG (matplotlib, Agg backend); one line
per cell built goes to stderr.

Stores, where the cells live:

* ``Memory()``: nowhere; every run builds every cell;
* ``JsonCells(path, key)``: one JSON file, written after every cell; ``key`` ``"nested"`` keeps
  ``{model: {build: cell}}``, ``"flat"`` ``{"model | build": cell}``, ``"build"`` ``{build: cell}``
  (one model, ``JsonCells(path, "build", model=label)``);
* ``ReportFiles(folder, name)``: one JSON file per cell, ``name(model, build)`` in ``folder``
  (``souffle-tvm compile --report``'s reports); ``build`` writes it.

Every figure a spec computes is its own; the runner only orders, caches and writes. The specs:
``k_tile_results``, ``k_tile_counted``, ``fetch_counted`` (its ``count``), ``lstm_layer_counted``,
``resident_results``, ``row_chain_results``, ``compile_time``, ``traffic_counted``.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

# {model label: {build label: cell}}; a cell missing where its store had none and nothing built it
Cells = dict[str, dict[str, Any]]


# == stores =======================================================================================
class Memory:
    """Cells of this run only."""

    def __init__(self):
        self.cells: dict[tuple[str, str], Any] = {}

    def has(self, model: str, build: str) -> bool:
        return (model, build) in self.cells

    def get(self, model: str, build: str) -> Any:
        return self.cells[(model, build)]

    def put(self, model: str, build: str, cell: Any) -> None:
        self.cells[(model, build)] = cell

    def models(self) -> list[str]:
        return list(dict.fromkeys(m for m, _ in self.cells))


class JsonCells(Memory):
    """Cells in one JSON file (see the module docstring for ``key``), rewritten after each cell."""

    def __init__(self, path: Path, key: str = "nested", model: str = ""):
        super().__init__()
        self.path, self.key = Path(path), key
        data = json.loads(self.path.read_text()) if self.path.exists() else {}
        for k, v in data.items():
            if key == "nested":
                for build, cell in v.items():
                    self.cells[(k, build)] = cell
            elif key == "flat":
                model, _, build = k.rpartition(" | ")
                self.cells[(model, build)] = v
            else:
                self.cells[(model, k)] = v

    def put(self, model: str, build: str, cell: Any) -> None:
        super().put(model, build, cell)
        self.save()

    def save(self) -> None:
        if self.key == "nested":
            data: dict = {}
            for (model, build), cell in self.cells.items():
                data.setdefault(model, {})[build] = cell
        elif self.key == "flat":
            data = {f"{model} | {build}": cell for (model, build), cell in self.cells.items()}
        else:
            data = {build: cell for (_, build), cell in self.cells.items()}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(data, indent=1))


class ReportFiles:
    """One JSON file per cell, ``folder / name(model, build)``; ``models()`` are those of the
    files already there (``split(file name) -> (model, build)`` or None for a file not a cell)."""

    def __init__(self, folder: Path, name: Callable[[str, str], str] = lambda m, b: f"{b}_{m}.json",
                 split: Callable[[str], tuple[str, str] | None] | None = None):
        self.folder, self.name, self.split = Path(folder), name, split

    def path(self, model: str, build: str) -> Path:
        return self.folder / self.name(model, build)

    def has(self, model: str, build: str) -> bool:
        return self.path(model, build).exists()

    def get(self, model: str, build: str) -> Any:
        return json.loads(self.path(model, build).read_text())

    def put(self, model: str, build: str, cell: Any) -> None:
        if cell is not None:        # a build that wrote its report itself returns None
            self.path(model, build).write_text(json.dumps(cell, indent=1))

    def models(self) -> list[str]:
        if self.split is None:      # "<build>_<model>.json"
            found = [p.stem.partition("_") for p in sorted(self.folder.glob("*.json"))]
            return list(dict.fromkeys(m for b, sep, m in found if sep))
        names = [self.split(p.name) for p in sorted(self.folder.glob("*.json"))]
        return list(dict.fromkeys(n[0] for n in names if n))


# == the spec and its run =========================================================================
@dataclass
class Spec:
    """One experiment (module docstring). ``build(model, options, cell)`` makes a cell: ``model``
    is the value ``run`` was given for the model's label, ``options`` the build's; ``cell`` says
    where it is (``Cell``: labels, the store's path for report files). ``build=None``: the cells
    must be in the store already (reports made elsewhere); the missing ones are left out."""
    name: str
    builds: dict[str, Any]
    rows: Callable[[Cells], Any]
    build: Callable[[Any, Any, "Cell"], Any] | None = None
    table: Callable[[Any], str] | None = None
    plot: Callable[[Any, Path], Any] | None = None      # (rows, PNG path); pyplot is on Agg
    plot_file: str | None = None
    table_file: str | None = None       # None: the table is printed only
    page: Callable[[Any, str], str] | None = None       # (rows, table) -> table_file's text
    rows_file: str | None = None        # the rows as JSON
    progress: Callable[[str, str, Any, float], str] | None = None    # one line per cell built (stderr)
    print_table: bool = True


@dataclass
class Cell:
    model: str
    build: str
    path: Path | None = None            # ReportFiles: the file the build writes


def pyplot():
    """matplotlib's pyplot on the Agg backend (files only; no display here or in CI)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def run(spec: Spec, out: Path, models: dict[str, Any] | None = None, store=None, builds: list[str] | None = None,
        redo: bool = False, build_only: list[str] | None = None) -> Any:
    """Build the missing cells of ``models`` (label -> what ``spec.build`` takes; None: the
    store's own) x ``builds`` (default all of the spec's), in that order, then the rows, table and
    plot into ``out``. ``redo``: build every cell again; ``build_only``: build only these models'
    cells (the rows still take every model's). Returns the rows."""
    out = Path(out)
    store = Memory() if store is None else store
    builds = list(builds or spec.builds)
    labels = list(models) if models is not None else store.models()
    if spec.build is not None:
        for model in (labels if build_only is None else [m for m in labels if m in build_only]):
            for build in builds:
                if store.has(model, build) and not redo:
                    continue
                where = Cell(model, build, store.path(model, build) if isinstance(store, ReportFiles) else None)
                if where.path is not None:
                    where.path.parent.mkdir(parents=True, exist_ok=True)
                t = time.perf_counter()
                cell = spec.build(models[model], spec.builds[build], where)
                store.put(model, build, cell)
                seconds = time.perf_counter() - t
                line = spec.progress(model, build, cell, seconds) if spec.progress else \
                    f"{model} {build}: {seconds:.1f} s"
                print(line, file=sys.stderr, flush=True)
    cells: Cells = {}
    for model in labels:
        for build in builds:
            if store.has(model, build):
                cells.setdefault(model, {})[build] = store.get(model, build)
    rows = spec.rows(cells)
    write(spec, rows, out)
    return rows


def write(spec: Spec, rows: Any, out: Path) -> None:
    """The spec's rows (JSON), table (Markdown, printed) and plot (PNG) in ``out``."""
    wants_files = spec.rows_file or spec.table_file or (spec.plot and spec.plot_file)
    if wants_files:
        out.mkdir(parents=True, exist_ok=True)
    if spec.rows_file:
        (out / spec.rows_file).write_text(json.dumps(rows, indent=1) + "\n")
    if spec.table:
        text = spec.table(rows)
        if spec.table_file:
            (out / spec.table_file).write_text(spec.page(rows, text) if spec.page else text + "\n")
        if spec.print_table:
            print(text)
    if spec.plot and spec.plot_file:
        plt = pyplot()
        spec.plot(rows, out / spec.plot_file)
        plt.close("all")


def markdown(header: list[str], rows: list[list[Any]]) -> str:
    """A Markdown table: ``| a | b |``, ``| --- | --- |``, then one line per row."""
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
