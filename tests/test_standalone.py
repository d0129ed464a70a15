"""Exported libraries run with the TVM runtime alone (what the GPU machine has), and the GPU
check's bundle is complete. The CUDA half needs a GPU; here the same loader runs llvm builds."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from conftest import needs_nvcc
from souffle_tvm.runtime import numerics
from souffle_tvm.build import ptxas as resources
from souffle_tvm.runtime import standalone
from souffle_tvm.pipeline.driver import compile as compile_model

ROOT = Path(__file__).resolve().parent.parent
GPU_CHECK = (sys.executable, "-m", "souffle_experiments", "gpu-check")


@pytest.mark.parametrize("fusion,level", [("tvm", "v2"), ("souffle", "v3")])
def test_exported_library_runs_without_the_tvm_package(tmp_path, fusion, level):
    c = compile_model("mmoe", "llvm", fusion, small=True, level=level)
    assert fusion == "tvm" or c.report.fallback is None, c.report.fallback
    lib = tmp_path / "m.so"
    c.export_library(str(lib))
    feeds = numerics.random_inputs(c.model.inputs, seed=3)
    np.savez(tmp_path / "io.npz", *[feeds[i.name] for i in c.model.inputs], *c.model.params)
    script = textwrap.dedent(f"""
        import sys, numpy as np
        from souffle_tvm.runtime import standalone
        standalone.load_runtime(standalone.installed_runtime_dir(), cuda=False)
        d = np.load({str(tmp_path / 'io.npz')!r})
        outs = standalone.VM({str(lib)!r}, "cpu")(*[d[k] for k in sorted(d.files, key=lambda k: int(k[4:]))])
        np.savez({str(tmp_path / 'out.npz')!r}, *[np.from_dlpack(o) for o in outs])
        assert "tvm" not in sys.modules, "the standalone path imported the compiler"
    """)
    # this checkout's souffle_tvm, as the GPU machine imports it (from the checkout, not installed)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True, env=env)
    got = np.load(tmp_path / "out.npz")
    _, ref = numerics.reference_outputs(c.model.onnx_model, feeds)
    cmp = numerics.compare(c.model.outputs, [got[k] for k in sorted(got.files)], ref)
    assert all(x.ok(1e-5) for x in cmp), cmp


def test_cubin_store_answers_by_source_and_counts(tmp_path):
    store = standalone.CubinStore(tmp_path, "sm_90")
    store.path("// a").write_bytes(b"\x7fELFcubin")
    assert store("// a") == b"\x7fELFcubin" and (store.hits, store.misses) == (1, 0)
    # the key is the ptxas cache's: one source, one compile, whichever asks first
    assert store.path("// a").name.startswith(standalone.cubin_key("// a", "sm_90"))


@needs_nvcc
def test_gpu_check_bundle_is_complete(tmp_path):
    bundle = tmp_path / "b"
    proc = subprocess.run([*GPU_CHECK, "prepare", "--bundle", str(bundle), "--models", "mmoe", "--sizes", "small",
                           "--no-wheel", "--fusions", "tvm", "souffle", "souffle-v2", "--ablation-sizes", "small"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    m = json.loads((bundle / "manifest.json").read_text())
    for name in standalone.RUNTIME_LIBS + standalone.CUDA_RUNTIME_LIBS:
        assert (bundle / "runtime" / name).exists()
    kinds = {p["kind"]: p for p in m["probes"]}
    ok, over = kinds["coresident"], kinds["oversized"]
    assert ok["grid"] == 132 * ok["predicted_blocks_per_sm"] and over["grid"] == ok["grid"] + 132
    assert ok["grid_sync"] and not kinds["nosync"]["grid_sync"]
    assert [c["id"] for c in m["cases"]] == ["mmoe-small-tvm", "mmoe-small-souffle", "mmoe-small-souffle-v2"]
    assert [c["level"] for c in m["cases"]] == [None, "v3", "v2"]
    assert m["cases"][2]["report"]["launches"] > 1 and not any(k["cooperative"] for k in m["cases"][2]["report"]["kernels"])
    for case in m["cases"]:
        assert (bundle / case["lib"]).exists() and (bundle / case["io_npz"]).exists()
        for k in case["report"]["kernels"]:
            assert (bundle / "cubins" / k["cubin"]).read_bytes()[:4] == b"\x7fELF"
    souffle = m["cases"][1]
    assert souffle["report"]["launches"] == 1 and souffle["report"]["kernels"][0]["cooperative"]
    # every weight is either regenerable from the zoo's seed or carried
    assert {p["src"] for c in m["cases"] for p in c["params"]} <= {"onnx", "npz"}
    assert resources.nvcc_path() is not None


@needs_nvcc
def test_gpu_check_probes_only_bundle_has_the_flagless_pass_form_probe(tmp_path):
    # what tests/test_gpu.py runs on a GPU: ``--models`` with no names builds the probes alone
    bundle = tmp_path / "probes"
    proc = subprocess.run([*GPU_CHECK, "prepare", "--bundle", str(bundle), "--models", "--no-wheel"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    m = json.loads((bundle / "manifest.json").read_text())
    kinds = {p["kind"]: p for p in m["probes"]}
    assert set(kinds) == {"coresident", "oversized", "nosync", "noflag"} and not m["cases"]
    # the pass form's kernel built with TVM's default TIR pipeline: no cooperative flag, so its
    # entry check is in; the cooperative pipeline's probe is flagged and has none
    noflag, flagged = (bundle / kinds["noflag"]["lib"]).read_bytes(), (bundle / kinds["coresident"]["lib"]).read_bytes()
    assert b"tirx.use_cooperative_launch" not in noflag and b"souffle_require_cooperative_grid();" in noflag
    assert b"tirx.use_cooperative_launch" in flagged and b"souffle_require_cooperative_grid" not in flagged
    assert kinds["noflag"]["grid"] == kinds["coresident"]["grid"] and not kinds["noflag"]["cooperative"]
    assert (bundle / "cubins" / kinds["noflag"]["cubin"]).read_bytes()[:4] == b"\x7fELF"


def test_gpu_check_reads_nsight_compute_csv():
    from souffle_experiments import gpu_check

    head = '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",' \
           '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"'
    row = '"{id}","1","python3","h","{k}","1","7","(256, 1, 1)","(528, 1, 1)","0","9.0","m","{metric}","{unit}","{v}"'
    text = "\n".join(["==PROF== Connected to process", head,
                      row.format(id=0, k="stitched", metric="dram__bytes_read.sum", unit="Mbyte", v="1.50"),
                      row.format(id=0, k="stitched", metric="dram__bytes_write.sum", unit="Kbyte", v="2,048.00"),
                      row.format(id=0, k="stitched", metric="sm__cycles.sum", unit="cycle", v="9"),
                      row.format(id=1, k="gemm", metric="dram__bytes_read.sum", unit="byte", v="100"),
                      "program output"])
    got = gpu_check.parse_ncu_csv(text)
    assert got["dram_read_bytes"] == 1_500_100 and got["dram_write_bytes"] == 2_048_000
    assert got["kernels_profiled"] == 2
    assert got["dram_bytes_by_kernel"] == {"stitched": 3_548_000, "gemm": 100}
    assert "error" in gpu_check.parse_ncu_csv("==ERROR== the profiler failed")
