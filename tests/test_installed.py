"""A non-editable install (issue 57): the package copied out of the repository, as a wheel
puts it, compiles, reads its shipped data and reads and writes its timing cache, with the
repository nowhere on its path."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PROBE = """
import json, sys
import souffle_tvm
from souffle_tvm.cost import shipped
from souffle_tvm.pipeline.driver import compile as compile_model
c = compile_model("mmoe", "llvm", "souffle", small=True, measure=True)
print(json.dumps({"package": souffle_tvm.__file__, "data": str(shipped.CONSTANTS),
                  "sets": len(shipped.leave_one_model_out()), "chosen": c.report.measured["chosen"],
                  "cached": [x["cached"] for x in c.report.measured["candidates"]]}))
"""


def test_a_non_editable_install_compiles_and_keeps_its_timing_cache(tmp_path):
    site = tmp_path / "site"
    build = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                            "--target", str(site), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-2000:]
    shutil.rmtree(ROOT / "build", ignore_errors=True)      # setuptools' scratch folder in the checkout
    work = tmp_path / "elsewhere"
    work.mkdir()
    # the installed copy first on the path; the repository's editable install cannot shadow it
    env = {**os.environ, "PYTHONPATH": str(site), "SOUFFLE_TVM_CACHE": str(tmp_path / "cache"),
           "SOUFFLE_TVM_PROGRESS": "0"}
    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", PROBE], cwd=work, env=env, capture_output=True, text=True,
                             timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert Path(first["package"]).is_relative_to(site) and Path(first["data"]).is_relative_to(site)
    assert not Path(first["package"]).is_relative_to(ROOT)
    assert first["sets"] >= 5
    assert not any(first["cached"])
    assert all(second["cached"][:2]) and second["chosen"] == first["chosen"]   # read back from its cache
    assert list((tmp_path / "cache" / "timing").glob("*.json"))
