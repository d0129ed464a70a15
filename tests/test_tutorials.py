"""The tutorials run top to bottom on a CPU-only machine (nbclient, a fresh kernel each)."""

import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="the test extra (make install) brings nbformat")
nbclient = pytest.importorskip("nbclient", reason="the test extra (make install) brings nbclient")

ROOT = Path(__file__).parent.parent
TUTORIALS = sorted((ROOT / "tutorials").glob("*.ipynb"))
# A tutorial the README runs in a tested block (``jupyter-execute``, real Jupyter: it fails on
# any error) runs there, not twice (tests/test_readme.py)
RUN_BY_README = {p for p in TUTORIALS if f"jupyter-execute tutorials/{p.name}" in (ROOT / "README.md").read_text()}


def test_three_tutorials_stored_without_outputs():
    assert [p.name for p in TUTORIALS] == ["01_quickstart.ipynb", "02_inside_the_analysis.ipynb",
                                           "03_bring_your_own_model.ipynb"]
    for path in TUTORIALS:
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        # outputs are made by running, never committed (diffs stay readable, results stay honest)
        assert all(not c.get("outputs") and c.get("execution_count") is None for c in nb.cells if c.cell_type == "code")


def test_the_readme_runs_one_tutorial_the_way_users_would():
    assert len(RUN_BY_README) == 1


@pytest.mark.parametrize("path", [p for p in TUTORIALS if p not in RUN_BY_README], ids=lambda p: p.stem)
def test_tutorial_runs_top_to_bottom(path, tmp_path):
    nb = nbformat.read(path, as_version=4)
    t = time.perf_counter()
    # cwd = a temporary folder: whatever a tutorial writes stays out of the checkout
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    seconds = time.perf_counter() - t
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    images = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert images, "every tutorial draws at least one plot inline"
    text = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    assert text.strip()
    print(f"{path.name}: {seconds:.1f} s")
