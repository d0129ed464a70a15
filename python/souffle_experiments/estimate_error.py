"""How far the static resource estimate (souffle_tvm/cost/estimate.py) is from ptxas.

For every small zoo model, build ``--fusion souffle --level v3`` for sm_90 with nvcc and compare,
per stitched kernel, the estimate the partitioner grows subprograms with against the registers
and shared memory ptxas reports. Prints a Markdown table (docs/partitioner.md carries one run).

    .venv/bin/python -m souffle_experiments estimate-error [--models bert,lstm] [--full]
"""

from __future__ import annotations

import argparse
import statistics

import tvm

from souffle_tvm import zoo
from souffle_tvm.cost import estimate
from souffle_tvm.stitch import kernel_ir
from souffle_tvm.pipeline.driver import compile as compile_model


def stitched_estimate(func: tvm.tirx.PrimFunc) -> estimate.Estimate:
    stages = [s for s in kernel_ir.stage_loops(func) if isinstance(s, tvm.tirx.For)]
    return estimate.kernel([estimate.stage(s.body) for s in stages])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(zoo.names()))
    ap.add_argument("--full", action="store_true", help="full-size models (slow)")
    args = ap.parse_args(argv)
    print("| model | kernel | stages | registers est. | ptxas | shared B est. | ptxas (static + dynamic) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    errors = []
    for name in args.models.split(","):
        c = compile_model(name, "cuda", "souffle", small=not args.full, level="v3")
        for k in c.report.kernels:
            if not k.cooperative or k.registers is None:
                continue
            est = stitched_estimate(c.model.mod[k.primfunc])
            errors.append((est.registers - k.registers) / k.registers)
            print(f"| {name} | {k.primfunc} | {len(k.stages or [])} | {est.registers} | {k.registers} "
                  f"| {est.shared_bytes} | {k.shared_bytes} |", flush=True)
    if errors:
        print(f"\nregisters: mean relative error {statistics.mean(errors):+.0%}, "
              f"mean absolute {statistics.mean(abs(e) for e in errors):.0%}, "
              f"worst {max(errors, key=abs):+.0%} over {len(errors)} kernels")
    return 0


if __name__ == "__main__":
    main()
