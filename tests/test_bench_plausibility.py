"""souffle_experiments.bench_plausibility on a hand-written bench.json: the fractions of the H200's peaks
(989 TFLOP/s tensor cores, 67 TFLOP/s FP32, 134 half2, 4.8 TB/s DRAM) computed here by hand,
which kernels are listed and flagged, the class totals and the before/after columns."""

from __future__ import annotations

import json

import pytest

from souffle_experiments import bench_plausibility as bp


def _row(name, form, launches, us, before_us, flops, bytes_, tensor_core=False, elem_bytes=4, **kw):
    timed = form.startswith("dlight") or form == "Fallback@256"     # cost/measured.py's TIMED_IN_TOTALS
    return dict({"name": name, "form": form, "measured_form": timed, "launches": launches,
                 "grid": 132, "threads": 256, "bytes": bytes_, "flops": flops, "tensor_core": tensor_core,
                 "elem_bytes": elem_bytes, "stitched": False, "predicted_us": us, "floor_us": us / 2,
                 "floor_by": "dram", "before_us": before_us}, **kw)


# name -> (arithmetic, DRAM) fraction after, by hand
EXPECTED = {
    # tensor cores: 6.923e9 flop / 10 us = 692.3 TFLOP/s = 0.7 of 989; 4.8 MB / 10 us = 0.48 TB/s = 0.1
    "tc_gemm": (0.7, 0.1),
    # half2 (fp16, no tensor core): 268 MFLOP / 4 us = 67 TFLOP/s = 0.5 of 134; 12.48 MB / 4 us = 0.65 of 4.8 TB/s
    "half2_rows": (0.5, 0.65),
    # half2 by the model's dtype (no elem_bytes in the row): 107.2 MFLOP / 2 us = 53.6 TFLOP/s = 0.4 of 134
    "half2_by_dtype": (0.4, 0.0),
    # FP32, TVM's own: 1.072 GFLOP / 20 us = 53.6 TFLOP/s = 0.8 of 67; 9.6 MB / 20 us = 0.1
    "dlight_gemm": (0.8, 0.1),
    "dlight_ew": (0.0, 0.05),        # 0.72 MB / 3 us = 0.24 TB/s
    # stitched, fp32: 335 MFLOP / 50 us = 6.7 TFLOP/s = 0.1; 24 MB / 50 us = 0.1
    "stitched": (0.1, 0.1),
    # 24 MB / 10 us = 2.4 TB/s = 0.5 after; in 5 us before: 1.0
    "before_only": (0.0, 0.5),
}


def _bench(before: bool = True) -> dict:
    tvm = [_row("dlight_gemm", "dlight Matmul", 1, 20.0, 10.0, 1_072_000_000, 9_600_000),
           _row("dlight_ew", "dlight", 3, 3.0, 3.0, 0, 720_000)]
    v3t = [_row("tc_gemm", "TensorCoreMatmul@256", 2, 10.0, 20.0, 6_923_000_000, 4_800_000, True, 2),
           _row("half2_rows", "RowReduction@256", 3, 4.0, 4.0, 268_000_000, 12_480_000, False, 2),
           _row("half2_by_dtype", "Fallback@256", 1, 2.0, 2.0, 107_200_000, 0, False, None),
           _row("stitched", "RowReduction@256 + StitchedMatmul@512", 1, 50.0, 40.0, 335_000_000, 24_000_000,
                stitched=True, measured_form=False),
           _row("before_only", "SerialReduction@256", 1, 10.0, 5.0, 0, 24_000_000)]
    model = {"model": "m", "dtype": "float16",
             "tvm": {"launches": 4, "predicted_graph_ms": 0.03, "predicted_graph_ms_before": 0.02, "kernel_rows": tvm},
             "v3": {"error": "RuntimeError: planted"},
             "v3t": {"launches": 8, "predicted_graph_ms": 0.1, "predicted_graph_ms_before": 0.2, "kernel_rows": v3t}}
    if not before:
        for c in ("tvm", "v3t"):
            model[c].pop("predicted_graph_ms_before")
            for r in model[c]["kernel_rows"]:
                r.pop("before_us")
    return {"date": "2026-12-03", "tvm": "0.27", "target": "cuda -arch=sm_90", "small": True, "compile": [model],
            "latency_constants": {"node_us": 0.5}, "latency_constants_before": {"node_us": 1.5},
            "rebuilt": [{"configs": ["v3t"], "date": "2026-12-04", "latency_constants": {"node_us": 0.7}}]}


@pytest.fixture()
def written(tmp_path):
    p = tmp_path / "bench.json"
    p.write_text(json.dumps(_bench()))
    assert bp.main([str(p)]) == 0
    return tmp_path


def test_fractions_by_hand():
    result = _bench()
    peaks = bp.peaks_for(result)
    assert (peaks.fp32_flops, peaks.fp16_flops, peaks.dram_bandwidth) == (67e12, 989e12, 4.8e12)
    got = {k.row["name"]: k for k in bp.checks(result, peaks)}
    assert set(got) == set(EXPECTED)
    for name, (arith, dram) in EXPECTED.items():
        assert got[name].arith == pytest.approx(arith, abs=1e-9), name
        assert got[name].dram == pytest.approx(dram, abs=1e-9), name
    assert {n: got[n].peak for n in ("tc_gemm", "half2_rows", "half2_by_dtype", "dlight_gemm")} == \
        {"tc_gemm": "tensor core", "half2_rows": "half2", "half2_by_dtype": "half2", "dlight_gemm": "fp32"}
    assert got["tc_gemm"].arith_before == pytest.approx(0.35)
    assert got["before_only"].dram_before == pytest.approx(1.0)


def test_listed_and_flagged():
    result = _bench()
    ks = bp.checks(result, bp.peaks_for(result))
    listed = {k.row["name"]: k.flag for k in ks if k.top > bp.THRESHOLD or (k.top_before or 0) > bp.THRESHOLD}
    assert listed == {"tc_gemm": bp.FLAG, "half2_rows": bp.FLAG, "dlight_gemm": "",
                      "before_only": bp.FLAG + " (before only)"}
    assert bp.kernel_class(next(k.row for k in ks if k.row["name"] == "stitched")) == "stitched"


def test_markdown_and_plot(written):
    md = (written / "plausibility.md").read_text()
    assert (written / "plausibility.png").stat().st_size > 10_000
    assert "ESTIMATES" in md and "not measurements" in md
    # forms never timed (measured_form false), a stitched kernel's stages one by one
    assert ("extrapolations): `RowReduction@256`, `SerialReduction@256`, `StitchedMatmul@512`, "
            "`TensorCoreMatmul@256`. Kernels in them per configuration: v3t 4.") in md
    # per model and config, before / after / ratio; the failed build named
    assert "| m | float16 | tvm | 2 | 4 | 0.020 | 0.030 | 1.50 |" in md
    assert "| m | float16 | v3t | 5 | 8 | 0.200 | 0.100 | 0.50 |" in md
    assert "| m | float16 | v3 | RuntimeError: planted |" in md
    assert "| m | 10.00 | 3.33 |" in md                  # v3t / tvm before (0.2 / 0.02), after (0.1 / 0.03)
    # class totals: v3t sums 2*10 + 3*4 + 2 + 50 + 10 = 94 us; before 40 + 12 + 2 + 40 + 5 = 99
    assert "| stitched * | v3t | 1 | 1 | 40.0 | 50.0 | 1.25 | 53.2% |" in md
    assert "| RowReduction@256 * | v3t | 1 | 3 | 12.0 | 12.0 | 1.00 | 12.8% |" in md
    assert "| Fallback@256 | v3t | 1 | 1 | 2.0 | 2.0 | 1.00 | 2.1% |" in md          # timed: no *
    assert "| dlight | tvm | 1 | 3 | 9.0 | 9.0 | 1.00 | 31.0% |" in md     # 9 of 20 + 9 = 29 us
    assert "7 kernels checked, 4 listed, 3 flagged." in md
    assert "| m | v3t | `tc_gemm` | `TensorCoreMatmul@256` | tensor core | 2 | 132 × 256 | 10.00 | dram | 0.70 | 0.10 | " \
           f"0.35 | 0.05 | {bp.FLAG} |" in md
    assert "| dlight Matmul | tvm | 1 | 0.800 | 0.800 | 0.100 | 0.100 |" in md
    assert "Constants after: node_us 0.5" in md and "Constants before: node_us 1.5" in md
    assert "Constants after (rebuilt 2026-12-04, --configs v3t): node_us 0.7" in md


def test_without_before(tmp_path):
    p = tmp_path / "bench.json"
    p.write_text(json.dumps(_bench(before=False)))
    assert bp.main([str(p)]) == 0
    md = (tmp_path / "plausibility.md").read_text()
    assert "before" not in md.split("## Predicted")[1].split("## Plausibility")[0].lower()
    assert "| m | float16 | v3t | 5 | 8 | 0.100 |" in md
    assert "| stitched * | v3t | 1 | 1 | 50.0 | 53.2% |" in md
    assert "7 kernels checked, 3 listed, 2 flagged." in md


def test_no_kernel_rows_writes_nothing(tmp_path):
    p = tmp_path / "bench.json"
    result = _bench()
    for c in ("tvm", "v3t"):
        del result["compile"][0][c]["kernel_rows"]
    p.write_text(json.dumps(result))
    assert bp.main([str(p)]) == 1
    assert not (tmp_path / "plausibility.md").exists()
