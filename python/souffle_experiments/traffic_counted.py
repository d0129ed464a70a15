"""Counted traffic against the report's analytic bytes, every kernel of every small zoo model.

For each small zoo model and build (``--fusion tvm``; Souffle v2, one kernel per group; Souffle
v3, stitched cooperative kernels), built for CUDA (sm_90, no nvcc needed): the report's analytic
bytes per kernel (``cost.tir_stats``) beside what the kernels execute in the GPU emulator
(``runtime.traffic``): distinct bytes, 32-byte sectors and sectors per warp request. The
comparisons are ``report.counted.attach``'s (a stitched kernel per stage function). Writes
``results/traffic-counted-<date>/`` (``traffic.json``, ``README.md``).

    .venv/bin/python -m souffle_experiments traffic [--models mmoe bert] [--configs tvm v3] [--out DIR]

A spec of the experiment runner (``runner``): models x configurations, one row per build.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

from souffle_tvm import zoo
from souffle_tvm.build import executable
from souffle_tvm.build.facts import cuda_facts
from souffle_tvm.core.targets import make_target
from souffle_tvm.frontend.importer import import_onnx
from souffle_tvm.pipeline import building, results
from souffle_tvm.pipeline.options import Options
from souffle_tvm.report import assemble, counted

from . import runner
from .paths import ROOT

CONFIGS = ("tvm", "v2", "v3", "v3-offchip")     # v3-offchip: v3 with every intermediate in global memory


def one(name: str, config: str) -> dict:
    """Build ``name`` (small) for CUDA as ``config``, count its kernels, compare."""
    target = make_target("cuda")
    m = import_onnx(name, small=True)
    t0 = time.perf_counter()
    if config == "tvm":
        result = executable.build(m.mod, target)
        report = assemble.render(cuda_facts(name, target, result, None, {"available": False, "seconds": 0, "note": ""}))
        mod, params, stitched = result.fused, m.params, []
    else:
        level, _, off = config.partition("-")
        souffle = results.run(m.mod, target, m.params, Options(level=level, onchip=off != "offchip"))
        result, facts, _ = building.build(m, souffle, target, False)     # the stitched kernels' facts too
        report = assemble.render(facts)
        mod, params, stitched = souffle.mod, souffle.params, souffle.stitched
    built = time.perf_counter() - t0
    held = counted.count(report, mod, target, m, params, result.footprints, stitched)
    kernels = [{"name": k.name, "launches": k.launches, "analytic_bytes": k.bytes, "stages": len(k.stages or []),
                **{key: k.counted[key] for key in ("distinct_bytes", "sectors", "requests", "sectors_per_request",
                                                  "sectors_exact", "shared_accesses", "outside")}}
               for k in report.kernels if k.counted]
    onchip = sum(sk.onchip_bytes > 0 for sk in stitched)
    return {"model": name, "config": config, "build_s": round(built, 1), "onchip_kernels": onchip,
            "channels_bytes": sum(sk.onchip_bytes for sk in stitched),
            "count_s": round(time.perf_counter() - t0 - built, 1),
            "launches": report.launches, "analytic_bytes": report.bytes, **report.counted,
            "held": [{"unit": h.unit, "analytic": h.analytic, "counted": h.counted} for h in held],
            "kernels": kernels}


def markdown(rows: list[dict], date: str) -> str:
    out = [f"# Counted traffic against the analytic bytes ({date})", "",
           "Small zoo models built for CUDA (sm_90), their kernels run in the GPU emulator "
           "(`souffle_tvm.runtime.traffic`, `python -m souffle_experiments traffic`). Per model and build: the "
           "report's analytic bytes per inference, the counted distinct bytes (each byte read or "
           "written once per launch; a stitched kernel's intermediates once), the bytes L1/L2 serve "
           "(32-byte sectors of every warp request), and how many analytic figures equal their "
           "counts (per kernel; per stage function in a stitched kernel; per PrimFunc where one is "
           "lowered to several kernels).", "",
           "`v3-offchip` is v3 with the on-chip channel off (`Options(onchip=False)`: every intermediate "
           "through global memory); shared accesses count the warp requests to shared memory.", "",
           "| model | build | launches | kernels with channels | analytic MB | counted distinct MB | sector MB | "
           "shared requests | analytic = counted |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        shared = sum(k.get("shared_accesses") or 0 for k in r["kernels"])
        out.append(f"| {r['model']} | {r['config']} | {r['launches']} | {r.get('onchip_kernels', 0)} | "
                   f"{r['analytic_bytes'] / 1e6:.4f} | {r['bytes'] / 1e6:.4f} | {r['sector_bytes'] / 1e6:.4f} | "
                   f"{shared} | {r['analytic_held']} |")
    out += ["", "## Where the analytic figure and the count differ", ""]
    diffs = [(r, d) for r in rows for d in r["differences"]]
    if not diffs:
        out.append("Nowhere.")
    for r, d in diffs:
        out.append(f"- {r['model']} {r['config']}, `{d['unit']}`: analytic {d['analytic']} B, counted {d['counted']} B")
    out += ["", "## Least coalesced kernels (most sectors per warp request)", "",
            "| model | build | kernel | sectors / request | exact |", "| --- | --- | --- | --- | --- |"]
    worst = sorted(((r, k) for r in rows for k in r["kernels"] if k["sectors_per_request"]),
                   key=lambda x: -x[1]["sectors_per_request"])[:12]
    for r, k in worst:
        out.append(f"| {r['model']} | {r['config']} | `{k['name']}` | {k['sectors_per_request']:.2f} | "
                   f"{'yes' if k['sectors_exact'] else 'upper bound'} |")
    outside = [(r, k) for r in rows for k in r["kernels"] if k["outside"]]
    if outside:
        out += ["", "## Accesses outside their buffer", ""]
        out += [f"- {r['model']} {r['config']}, `{k['name']}`: {k['outside']} access(es) (stores not made in the "
                "emulator)" for r, k in outside]
    return "\n".join(out) + "\n"


def spec(date: str) -> runner.Spec:
    """traffic.json ({"date", "rows"}) and README.md (``markdown``), one row per model and build."""
    return runner.Spec("traffic", dict(zip(CONFIGS, CONFIGS)),
                       rows=lambda cells: {"date": date, "rows": [r for c in cells.values() for r in c.values()]},
                       build=lambda name, config, _: one(name, config),
                       table=lambda r: markdown(r["rows"], r["date"]).rstrip("\n"), table_file="README.md",
                       rows_file="traffic.json", print_table=False,
                       progress=lambda m, b, r, _: f"{m} {b} ... {r['analytic_held']} ({r['build_s']} s build, "
                                                   f"{r['count_s']} s counted)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="*", default=zoo.names())
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=CONFIGS)
    ap.add_argument("--out", default=None, help="output folder (default results/traffic-counted-<date>)")
    args = ap.parse_args(argv)
    date = datetime.date.today().isoformat()
    out = Path(args.out or ROOT / "results" / f"traffic-counted-{date}")
    runner.run(spec(date), out, dict(zip(args.models, args.models)), builds=args.configs)
    print(out / "README.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
