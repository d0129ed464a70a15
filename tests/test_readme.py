"""Every README example tagged ```sh tested / ```python tested runs, as a user would type it."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
BIN = Path(sys.executable).parent        # .venv/bin: souffle-tvm, jupyter-execute
FENCE = re.compile(r"^```(sh|python) tested\n(.*?)^```", re.S | re.M)
OUTPUT_FLAGS = re.compile(r"(?:-o|--output|--report|--html|--json|--outputs)\s+(\S+)")


def blocks() -> list[tuple[str, str]]:
    return FENCE.findall((ROOT / "README.md").read_text())


def test_each_surface_has_tested_examples():
    langs = [lang for lang, _ in blocks()]
    assert langs.count("sh") >= 2 and langs.count("python") >= 2
    text = (ROOT / "README.md").read_text()
    for heading in ("## Command line", "## Python", "## Passes", "## Tutorials"):
        section = text.split(heading, 1)[1].split("\n## ", 1)[0]
        assert " tested\n" in section, f"{heading} has no tested example"


@pytest.mark.parametrize("index", range(len(blocks())), ids=lambda i: f"{blocks()[i][0]}{i}")
def test_readme_block_runs(index, tmp_path):
    lang, code = blocks()[index]
    (tmp_path / "tutorials").symlink_to(ROOT / "tutorials")     # blocks may name repo paths
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "MPLBACKEND": "Agg"}
    if lang == "sh":
        cmd = ["bash", "-euo", "pipefail", "-c", code]
    else:
        cmd = [sys.executable, "-c", code]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{lang} block {index} failed:\n{code}\n--- stdout\n{proc.stdout[-3000:]}\n" \
                                 f"--- stderr\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr
    # what the block says it writes, it wrote
    for name in OUTPUT_FLAGS.findall(code) + re.findall(r"save\([^,]+, \"([^\"]+)\"\)", code):
        assert (tmp_path / name).exists(), name
