"""Re-pricing and plausibility of a `make bench` result (souffle_experiments/bench.py's bench.json).

    .venv/bin/python -m souffle_experiments bench-plausibility results/bench-<date>/bench.json

Writes ``plausibility.md`` and ``plausibility.png`` next to the bench.json, from the compact
per-kernel rows (``kernel_rows``) bench.py keeps for tvm, v3 and v3t:

* per model and configuration, the latency model's predicted ms under a CUDA graph, after
  (the fitted constants) and before (``latency.BEFORE``, where the run had it), and the ratio;
* per kernel class (its schedule form; stitched kernels are one class, ``stitched``) and
  configuration: kernels, Σ launches × predicted µs (after, before) and its share of the model;
* the plausibility check: each kernel's achieved rate under its predicted time, flops / time as
  a fraction of the H200's arithmetic peak for its form (tensor cores: ``gpu.fp16_flops``;
  otherwise ``gpu.fp32_flops``, doubled for 2-byte elements: half2) and bytes / time as a
  fraction of ``gpu.dram_bandwidth``; every kernel above ``THRESHOLD`` of either is listed, and
  flagged where its form is not TVM's own (dlight): no untuned schedule runs that close to peak.

All figures are ESTIMATES of the latency model (souffle_tvm/cost/latency.py), not measurements.
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

THRESHOLD = 0.6
CONFIGS = ("tvm", "v3", "v3t")
FLAG = "implausible for an untuned schedule"
COLOURS = {"tvm": "#7f7f7f", "v3": "#d94801", "v3t": "#54278f"}


@dataclass(frozen=True)
class Peaks:
    """What the fractions are of (a ``hardware.GPU``'s datasheet figures)."""
    name: str
    fp32_flops: float
    fp16_flops: float
    dram_bandwidth: float


def peaks_for(result: dict) -> Peaks:
    from souffle_tvm.cost import hardware

    gpu = hardware.for_arch(result.get("target", "cuda -arch=sm_90").split("-arch=")[-1])
    return Peaks(gpu.name, gpu.fp32_flops, gpu.fp16_flops, gpu.dram_bandwidth)


def _timed(form: str) -> bool:
    from souffle_tvm.cost import measured

    return measured.timed_in_a_total(form)


def kernel_class(row: dict) -> str:
    """A kernel's class: its form, or ``stitched`` for a stitched kernel (several stages)."""
    form = row.get("form") or "(no form)"
    return "stitched" if row.get("stitched") or "+" in form else form


def tvm_own(row: dict) -> bool:
    """TVM's own schedule (dlight's rules), the tuned baseline: not flagged near peak."""
    return (row.get("form") or "").startswith("dlight")


def elem_bytes(row: dict, dtype: str | None) -> int:
    """The kernel's element size: its row's, else the model's dtype's."""
    return row.get("elem_bytes") or (2 if dtype == "float16" else 4)


def arithmetic_peak(row: dict, peaks: Peaks, dtype: str | None = None) -> tuple[float, str]:
    """(FLOP/s, name) of the peak for the kernel's form: tensor cores, else the FP32 pipes,
    twice that on 2-byte elements (half2: two fp16 operations per instruction)."""
    if row.get("tensor_core"):
        return peaks.fp16_flops, "tensor core"
    if elem_bytes(row, dtype) == 2:
        return 2 * peaks.fp32_flops, "half2"
    return peaks.fp32_flops, "fp32"


def fractions(row: dict, peaks: Peaks, dtype: str | None = None, key: str = "predicted_us") -> tuple[float, float] | None:
    """(arithmetic, DRAM) fraction of peak the kernel achieves in its ``key`` time (µs, one
    launch); None without a time."""
    us = row.get(key)
    if not us or us <= 0:
        return None
    seconds = us * 1e-6
    return (row.get("flops") or 0) / seconds / arithmetic_peak(row, peaks, dtype)[0], \
        (row.get("bytes") or 0) / seconds / peaks.dram_bandwidth


@dataclass
class KernelCheck:
    model: str
    config: str
    row: dict
    klass: str
    peak: str
    arith: float
    dram: float
    arith_before: float | None = None
    dram_before: float | None = None

    @property
    def top(self) -> float:
        return max(self.arith, self.dram)

    @property
    def top_before(self) -> float | None:
        return None if self.arith_before is None else max(self.arith_before, self.dram_before)

    @property
    def flag(self) -> str:
        if tvm_own(self.row):
            return ""
        if self.top > THRESHOLD:
            return FLAG
        if (self.top_before or 0) > THRESHOLD:
            return FLAG + " (before only)"
        return ""


def configs_of(r: dict) -> list[str]:
    """The configurations of a model row that carry per-kernel rows."""
    return [c for c in CONFIGS if isinstance(r.get(c), dict) and r[c].get("kernel_rows")]


def checks(result: dict, peaks: Peaks) -> list[KernelCheck]:
    """Every kernel's fractions of peak, after (and before where the row has ``before_us``)."""
    out = []
    for r in result["compile"]:
        for c in configs_of(r):
            for row in r[c]["kernel_rows"]:
                f = fractions(row, peaks, r.get("dtype"))
                if f is None:
                    continue
                b = fractions(row, peaks, r.get("dtype"), "before_us")
                out.append(KernelCheck(r["model"], c, row, kernel_class(row), arithmetic_peak(row, peaks, r.get("dtype"))[1],
                                       f[0], f[1], *(b if b else (None, None))))
    return out


def has_before(result: dict) -> bool:
    return any(r[c].get("predicted_graph_ms_before") is not None or
               any("before_us" in k for k in r[c]["kernel_rows"])
               for r in result["compile"] for c in configs_of(r))


def class_totals(rows: list[dict]) -> dict[str, dict]:
    """Per kernel class: kernels, launches, Σ launches × predicted µs (and × before µs where known)."""
    out: dict[str, dict] = {}
    for row in rows:
        t = out.setdefault(kernel_class(row), {"kernels": 0, "launches": 0, "us": 0.0, "before_us": 0.0,
                                                "untimed": False})
        t["kernels"] += 1
        t["launches"] += row["launches"]
        t["us"] += row["launches"] * (row.get("predicted_us") or 0.0)
        t["before_us"] += row["launches"] * (row.get("before_us") or 0.0)
        t["untimed"] |= row.get("measured_form") is False
    return out


def _ms(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def _ratio(a, b) -> str:
    return "-" if not a or not b else f"{a / b:.2f}"


def never_timed(result: dict) -> tuple[list[str], dict[str, int]]:
    """(forms no GPU has timed, kernels per config in them): from the rows' ``measured_form``;
    a stitched kernel's stage forms listed one by one (those not timed on their own)."""
    forms, counts = set(), {}
    for r in result["compile"]:
        for c in configs_of(r):
            for row in r[c]["kernel_rows"]:
                if row.get("measured_form") is False:
                    counts[c] = counts.get(c, 0) + 1
                    parts = [f.strip() for f in (row.get("form") or "(no form)").split("+")]
                    forms.update(p for p in parts if len(parts) == 1 or not _timed(p))
    return sorted(forms), counts


def markdown(result: dict, peaks: Peaks, ks: list[KernelCheck]) -> str:
    before = has_before(result)
    forms, untimed = never_timed(result)
    lines = [f"# Re-pricing and plausibility, {result.get('date', '?')}", "",
             f"**These are ESTIMATES of the latency model (souffle_tvm/cost/latency.py) for the {peaks.name}, "
             "not measurements**: no GPU ran these kernels. "
             + ("`after`: the fitted constants (`latency.FITTED`); `before`: the model before its latest terms "
                "(`latency.BEFORE`: no sector term, global requests' sectors not priced as L2 traffic; the "
                "constants fitted without it), priced in the same run on the same kernels, as built by today's choices "
                "(a build the old model chose could differ). " if before else
                "This run had no `latency.BEFORE`: only the current model's figures. ")
             + f"Compiled at {'small' if result.get('small') else 'full'} size, TVM {result.get('tvm', '?')}, "
             f"{result.get('target', '?')}.", "",
             "Forms never timed on a GPU (`measured_form` false; their kernels' predictions are extrapolations): "
             + (", ".join(f"`{f}`" for f in forms) or "none") + "."
             + (f" Kernels in them per configuration: {', '.join(f'{c} {n}' for c, n in sorted(untimed.items()))}."
                if untimed else ""), ""]

    # 1. per model and configuration
    lines += ["## Predicted ms per inference (under a CUDA graph)", ""]
    if before:
        lines += ["| model | dtype | config | kernels | launches | before ms | after ms | after / before |",
                  "|---|---|---|---|---|---|---|---|"]
    else:
        lines += ["| model | dtype | config | kernels | launches | ms |", "|---|---|---|---|---|---|"]
    speedups = []
    for r in result["compile"]:
        for c in CONFIGS:
            v = r.get(c) or {}
            if "error" in v or not v:
                if v:
                    lines.append(f"| {r['model']} | {r.get('dtype')} | {c} | {v['error'][:80]} |")
                continue
            after, prior = v.get("predicted_graph_ms"), v.get("predicted_graph_ms_before")
            cells = [r["model"], r.get("dtype"), c, str(len(v.get("kernel_rows") or [])) if v.get("kernel_rows") else "-",
                     str(v.get("launches", "-"))]
            cells += [_ms(prior), _ms(after), _ratio(after, prior)] if before else [_ms(after)]
            lines.append("| " + " | ".join(map(str, cells)) + " |")
        t, vt = r.get("tvm") or {}, r.get("v3t") or {}
        if t.get("predicted_graph_ms") and vt.get("predicted_graph_ms"):
            speedups.append((r["model"], _ratio(vt.get("predicted_graph_ms_before"), t.get("predicted_graph_ms_before")),
                             _ratio(vt["predicted_graph_ms"], t["predicted_graph_ms"])))
    if speedups:
        lines += ["", "v3t over tvm under one graph (below 1: Souffle predicted faster):", "",
                  "| model | before | after |" if before else "| model | v3t / tvm |",
                  "|---|---|---|" if before else "|---|---|"]
        lines += [f"| {m} | {b} | {a} |" if before else f"| {m} | {a} |" for m, b, a in speedups]

    # 2. per kernel class
    lines += ["", "## Per kernel class: Σ launches × predicted µs per inference", "",
              "Class: the kernel's schedule form (`dlight <rule>`: TVM's own; `<Rule>@<threads>`: Souffle's), "
              "`stitched` for every stitched kernel. Share: of the model's Σ over its kernels in that "
              "configuration (after). `*`: some kernel of the class is in a form never timed."]
    everything: dict[tuple[str, str], dict] = {}
    for r in result["compile"]:
        cs = configs_of(r)
        if not cs:
            continue
        lines += ["", f"### {r['model']} ({r.get('dtype')})", ""]
        head = "| class | config | kernels | launches | " + ("Σ µs before | Σ µs after | after / before | " if before
                                                          else "Σ µs | ") + "share |"
        lines += [head, "|" + "---|" * (head.count("|") - 1)]
        for c in cs:
            totals = class_totals(r[c]["kernel_rows"])
            model_us = sum(t["us"] for t in totals.values()) or 1.0
            for klass, t in sorted(totals.items(), key=lambda kv: -kv[1]["us"]):
                e = everything.setdefault((c, klass), {"kernels": 0, "launches": 0, "us": 0.0, "before_us": 0.0,
                                                        "untimed": False})
                for k in ("kernels", "launches", "us", "before_us"):
                    e[k] += t[k]
                e["untimed"] |= t["untimed"]
                name = klass + (" *" if t["untimed"] else "")
                sums = [f"{t['before_us']:.1f}", f"{t['us']:.1f}", _ratio(t["us"], t["before_us"])] if before \
                    else [f"{t['us']:.1f}"]
                lines.append(f"| {name} | {c} | {t['kernels']} | {t['launches']} | " + " | ".join(sums)
                             + f" | {t['us'] / model_us:.1%} |")
    if everything:
        lines += ["", "### All models together (share: of the configuration's Σ over every model)", "", head, "|" + "---|" * (head.count("|") - 1)]
        for c in CONFIGS:
            config_us = sum(e["us"] for (cc, _), e in everything.items() if cc == c) or 1.0
            for (cc, klass), e in sorted(everything.items(), key=lambda kv: -kv[1]["us"]):
                if cc != c:
                    continue
                sums = [f"{e['before_us']:.1f}", f"{e['us']:.1f}", _ratio(e["us"], e["before_us"])] if before \
                    else [f"{e['us']:.1f}"]
                lines.append(f"| {klass + (' *' if e['untimed'] else '')} | {c} | {e['kernels']} | {e['launches']} | "
                             + " | ".join(sums) + f" | {e['us'] / config_us:.1%} |")

    # 3. plausibility
    listed = [k for k in ks if k.top > THRESHOLD or (k.top_before or 0) > THRESHOLD]
    listed.sort(key=lambda k: -max(k.top, k.top_before or 0))
    flagged = [k for k in listed if k.flag]
    lines += ["", f"## Plausibility: achieved rate under the predicted time, as a fraction of the {peaks.name}'s peak",
              "", f"Arithmetic: flops / predicted time over the peak for the kernel's form (tensor cores "
              f"{peaks.fp16_flops / 1e12:.0f} TFLOP/s; FP32 pipes {peaks.fp32_flops / 1e12:.0f}, twice that on 2-byte "
              f"elements, half2); DRAM: bytes / predicted time over {peaks.dram_bandwidth / 1e12:.1f} TB/s. "
              f"Every kernel above {THRESHOLD} of either peak (after{', or before' if before else ''}) is listed; "
              f"those in forms other than TVM's own (dlight) are flagged \"{FLAG}\". "
              f"{len(ks)} kernels checked, {len(listed)} listed, {len(flagged)} flagged.", ""]
    if listed:
        head = ("| model | config | kernel | form | peak | launches | grid × threads | µs | floor by | arith | DRAM | "
                + ("arith before | DRAM before | " if before else "") + "flag |")
        lines += [head, "|" + "---|" * (head.count("|") - 1)]
        for k in listed:
            row = k.row
            cells = [k.model, k.config, f"`{row['name'][:48]}`", f"`{row.get('form')}`", k.peak, row["launches"],
                     f"{row.get('grid')} × {row.get('threads')}", f"{row['predicted_us']:.2f}", row.get("floor_by") or "-",
                     f"{k.arith:.2f}", f"{k.dram:.2f}"]
            if before:
                cells += ["-" if k.arith_before is None else f"{k.arith_before:.2f}",
                          "-" if k.dram_before is None else f"{k.dram_before:.2f}"]
            cells.append(k.flag or "-")
            lines.append("| " + " | ".join(map(str, cells)) + " |")
    lines += ["", "### Distribution per class (after)", "",
              "| class | config | kernels | arith median | arith max | DRAM median | DRAM max |", "|---|---|---|---|---|---|---|"]
    groups: dict[tuple[str, str], list[KernelCheck]] = {}
    for k in ks:
        groups.setdefault((k.klass, k.config), []).append(k)
    for (klass, c), g in sorted(groups.items(), key=lambda kv: (CONFIGS.index(kv[0][1]), kv[0][0])):
        a, d = [k.arith for k in g], [k.dram for k in g]
        lines.append(f"| {klass} | {c} | {len(g)} | {statistics.median(a):.3f} | {max(a):.3f} | "
                     f"{statistics.median(d):.3f} | {max(d):.3f} |")
    lines += _constants_lines(result)
    lines += ["", "![fraction of peak per kernel](plausibility.png)"]
    return "\n".join(lines) + "\n"


def _constants_lines(result: dict) -> list[str]:
    """The constants behind the figures: the first run's, then each ``--configs`` rebuild's that
    priced with other constants (its configurations' rows are priced with those)."""
    runs = [("", result)] + [(f" (rebuilt {r.get('date')}, --configs {' '.join(r.get('configs', []))}"
                              + (f" --models {' '.join(r['models'])}" if r.get("models") else "") + ")", r)
                             for r in result.get("rebuilt", [])]
    lines = []
    for label, run in runs:
        for key, name in (("latency_constants", "after"), ("latency_constants_before", "before")):
            if run.get(key):
                lines += ["", f"Constants {name}{label}: " + ", ".join(f"{k} {v}" for k, v in run[key].items())]
    return lines


def plot(ks: list[KernelCheck], peaks: Peaks, out: Path) -> Path | None:
    """Fraction of arithmetic peak vs fraction of DRAM bandwidth per kernel, log axes, coloured by
    configuration (triangles: forms never timed); a zero fraction drawn at the axis' floor."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:          # matplotlib: the bench and test extras
        print(f"no plot: {err}", flush=True)
        return None
    lo = 1e-6
    fig, ax = plt.subplots(figsize=(7.5, 6))
    for c in CONFIGS:
        for untimed, marker in ((False, "o"), (True, "^")):
            sel = [k for k in ks if k.config == c and (k.row.get("measured_form") is False) == untimed]
            if sel:
                ax.scatter([max(k.dram, lo) for k in sel], [max(k.arith, lo) for k in sel], s=18, alpha=0.6,
                           color=COLOURS.get(c, "black"), marker=marker, edgecolors="none",
                           label=f"{c}{' (form never timed)' if untimed else ''} ({len(sel)})")
    ax.axvline(THRESHOLD, color="red", lw=0.8, ls="--")
    ax.axhline(THRESHOLD, color="red", lw=0.8, ls="--")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo * 0.7, 2)
    ax.set_ylim(lo * 0.7, 2)
    ax.set_xlabel(f"bytes / predicted time, fraction of DRAM bandwidth ({peaks.dram_bandwidth / 1e12:.1f} TB/s)")
    ax.set_ylabel("flops / predicted time, fraction of the form's arithmetic peak")
    ax.set_title(f"Per kernel, latency-model ESTIMATES for the {peaks.name} (dashed: {THRESHOLD})", fontsize=10)
    if ks:
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path = out / "plausibility.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0
    if len(args) != 1:
        print(__doc__.strip().split("\n\n")[1], file=sys.stderr)
        return 2
    path = Path(args[0])
    result = json.loads(path.read_text())
    peaks = peaks_for(result)
    ks = checks(result, peaks)
    if not ks:      # a bench.json from before bench.py kept kernel_rows, or every build failed
        print(f"{path}: no per-kernel rows (kernel_rows, which bench.py keeps for {', '.join(CONFIGS)}): "
              "nothing written", file=sys.stderr)
        return 1
    md = path.parent / "plausibility.md"
    md.write_text(markdown(result, peaks, ks))
    png = plot(ks, peaks, path.parent)
    print(md)
    if png:
        print(png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
