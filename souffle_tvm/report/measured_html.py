"""The HTML report's "Measured" section (``compile --measure``): each candidate's predicted and
measured time, the one kept and why, and a plot of predicted against measured (per candidate
and per kernel, log-log, the diagonal a perfect prediction); bars of the measured times where
nothing was predicted (a CPU target)."""

from __future__ import annotations

import math
from html import escape

from .schema import Report

W, H, PAD = 460, 360, 48


def section(r: Report) -> str:
    m = r.measured
    if not m:
        return ""
    rows = []
    for c in m["candidates"]:
        kept = "kept" if c["name"] == m["chosen"] else ""
        rows.append(f"<tr><td>{escape(c['name'])}</td><td class=n>{_ms(c.get('predicted_ms'))}</td>"
                    f"<td class=n>{_ms(c.get('ms'))}</td><td class=n>{_ms(c.get('spread_ms'))}</td>"
                    f"<td>{'yes' if c.get('matched') else 'no' if c.get('matched') is False else '-'}</td>"
                    f"<td>{'cache' if c.get('cached') else 'timed'}</td><td><b>{kept}</b></td>"
                    f"<td class=note>{escape(c.get('note') or '')}</td></tr>")
    timed = [k.timed for k in r.kernels if k.timed]
    return (f"<h2>Measured on {escape(m['where'])}</h2><p>Kept <b>{escape(m['chosen'])}</b>: {escape(m['why'])}. "
            f"Outputs checked against {escape(m['reference'])} (relative L2 below {m['tolerance']:.0e}); "
            f"times are medians with their interquartile range; the timing cache is <code>{escape(m['cache'])}</code>."
            f"</p><table><thead><tr><th>candidate</th><th>predicted ms</th><th>measured ms</th><th>IQR ms</th>"
            f"<th>matched</th><th>from</th><th></th><th>note</th></tr></thead><tbody>{''.join(rows)}</tbody></table>"
            f"<p class=note>Kernels of the kept build: {timed.count('here')} measured here, "
            f"{timed.count('elsewhere')} measured elsewhere, {timed.count('predicted')} predicted only.</p>"
            f"<div class='graph'>{plot(r)}</div>")


def _ms(x) -> str:
    return "-" if x is None else f"{x:.4f}"


def points(r: Report) -> list[tuple[str, float, float]]:
    """(label, predicted, measured) in microseconds: the candidates, then the kept build's kernels."""
    out = [(c["name"], c["predicted_ms"] * 1e3, c["ms"] * 1e3) for c in r.measured["candidates"]
           if c.get("predicted_ms") and c.get("ms")]
    out += [(k.name, k.predicted_us, k.measured_us) for k in r.kernels if k.predicted_us and k.measured_us]
    return out


def plot(r: Report) -> str:
    pts = points(r)
    if pts:
        return _scatter(pts)
    bars = [(c["name"], c["ms"]) for c in r.measured["candidates"] if c.get("ms")]
    top = max((v for _, v in bars), default=1.0)
    svg = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{W + 200}' height='{26 * len(bars) + 8}' "
           f"role='img' aria-label='measured time per candidate'>"]
    for i, (name, v) in enumerate(bars):
        y = 4 + 26 * i
        svg.append(f"<text x='0' y='{y + 14}' font-size='12'>{escape(name)}</text>"
                   f"<rect x='160' y='{y}' width='{max(2, W * v / top):.0f}' height='18' rx='3' fill='#6c8ebf'/>"
                   f"<text x='{166 + W * v / top:.0f}' y='{y + 14}' font-size='12'>{v:.4f} ms</text>")
    return "".join(svg) + "</svg>"


def _scatter(pts: list[tuple[str, float, float]]) -> str:
    lo = min(min(p, m) for _, p, m in pts) / 1.5
    hi = max(max(p, m) for _, p, m in pts) * 1.5
    span = math.log10(hi) - math.log10(lo)

    def at(v: float, size: int) -> float:
        return PAD + (size - 2 * PAD) * (math.log10(v) - math.log10(lo)) / span

    svg = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{W}' height='{H}' role='img' "
           f"aria-label='predicted against measured time'>",
           f"<line x1='{at(lo, W):.1f}' y1='{H - at(lo, H):.1f}' x2='{at(hi, W):.1f}' y2='{H - at(hi, H):.1f}' "
           f"stroke='#b0b7c3' stroke-dasharray='4 3'/>",
           f"<text x='{W / 2:.0f}' y='{H - 8}' font-size='12' text-anchor='middle'>measured (us, log)</text>",
           f"<text x='14' y='{H / 2:.0f}' font-size='12' transform='rotate(-90 14 {H / 2:.0f})' "
           f"text-anchor='middle'>predicted (us, log)</text>"]
    for label, p, m in pts:
        svg.append(f"<circle cx='{at(m, W):.1f}' cy='{H - at(p, H):.1f}' r='4' fill='#6c8ebf' fill-opacity='0.8'>"
                   f"<title>{escape(label)}: predicted {p:.2f} us, measured {m:.2f} us</title></circle>")
    return "".join(svg) + "</svg>"
