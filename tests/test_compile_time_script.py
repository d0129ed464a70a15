"""`python -m souffle_experiments compile-time`: the default's compile time against --fusion tvm, one fresh process per build."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow      # two fresh compiles, ~12 s: make test-all
def test_compile_time_script_writes_its_table(tmp_path):
    out = tmp_path / "ct"
    subprocess.run([sys.executable, "-m", "souffle_experiments", "compile-time", "--models", "mmoe", "--out", str(out)],
                   check=True, cwd=ROOT, capture_output=True, timeout=600)
    (row,) = json.loads((out / "compile_time.json").read_text())
    assert row["model"] == "mmoe" and row["tvm_s"] > 0 and row["default_s"] > 0
    assert abs(row["ratio"] - row["default_s"] / row["tvm_s"]) < 0.01
    assert row["returned"] in ("souffle", "tvm") and row["launches"] > 0
    table = (out / "README.md").read_text()
    assert f"| mmoe | {row['tvm_s']:.1f} | {row['default_s']:.1f} | {row['ratio']:.2f}x |" in table
