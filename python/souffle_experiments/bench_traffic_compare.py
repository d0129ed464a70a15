"""The bench's traffic columns of two runs side by side (``bench.json`` of ``souffle_experiments/bench.py``).

Used for issue 30's counting fix: the same compile matrix run at the commit before the fix and
at the commit after it, each run whole at one commit; this prints (or writes) per model and
configuration the global bytes per inference and the latency model's graph prediction of both.

    .venv/bin/python -m souffle_experiments bench-traffic-compare BEFORE/bench.json AFTER/bench.json [-o README.md]
"""

from __future__ import annotations

import argparse
import json
import sys

CONFIGS = ("tvm", "v2", "v3", "v3t")


def table(before: dict, after: dict, labels: tuple[str, str]) -> str:
    rows = ["| model | build | MB " + labels[0] + " | MB " + labels[1] + " | change | Souffle / TVM "
            + labels[0] + " | Souffle / TVM " + labels[1] + " | graph ms " + labels[0] + " | graph ms "
            + labels[1] + " |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    after_rows = {r["model"]: r for r in after["compile"]}
    for b in before["compile"]:
        a = after_rows.get(b["model"])
        if a is None:
            continue
        for key in CONFIGS:
            x, y = b.get(key), a.get(key)
            if not x or not y:
                continue
            ratio_b = x["bytes"] / b["tvm"]["bytes"] if b.get("tvm") else float("nan")
            ratio_a = y["bytes"] / a["tvm"]["bytes"] if a.get("tvm") else float("nan")
            rows.append(f"| {b['model']} | {key} | {x['bytes'] / 1e6:.1f} | {y['bytes'] / 1e6:.1f} | "
                        f"{(y['bytes'] - x['bytes']) / x['bytes'] * 100:+.1f}% | {ratio_b:.2f} | {ratio_a:.2f} | "
                        f"{x.get('predicted_graph_ms') or 0:.3f} | {y.get('predicted_graph_ms') or 0:.3f} |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--labels", nargs=2, default=("before", "after"))
    ap.add_argument("-o", "--output", default=None, help="write the table here (default: print it)")
    args = ap.parse_args(argv)
    with open(args.before) as f:
        before = json.load(f)
    with open(args.after) as f:
        after = json.load(f)
    text = table(before, after, tuple(args.labels))
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
