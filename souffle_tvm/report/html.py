"""A compiled model's :class:`~souffle_tvm.report.Report` as one self-contained HTML page.

Everything is inline (CSS, SVG; no script, fonts or network), so the file can be mailed,
attached to CI or opened offline. The page shows the totals, the kernel-group graph drawn by
a small layered layout in pure Python (no Graphviz needed) with subprogram (= stitched kernel)
boundaries, why every boundary was drawn, and per kernel its stages, grid, block, registers,
shared memory, grid syncs, bytes and flops.
"""

from __future__ import annotations

from collections import Counter
from html import escape

from . import measured_html
from .schema import Report, dims, si

MAX_GRAPH_NODES = 400   # beyond this the picture is unreadable anyway; the tables list every group
NODE_W, NODE_H, GAP_X, GAP_Y = 190, 38, 26, 34
# Colour per subprogram, cycled; chosen to stay distinct next to each other and readable with dark text.
PALETTE = ["#cfe3ff", "#ffe0b8", "#d6f5d6", "#f7d4ee", "#e6dcff", "#fff3b0", "#cdeff3", "#f9d3d3"]

CSS = """
body{font:14px/1.45 system-ui,-apple-system,'Segoe UI',Roboto,'DejaVu Sans',sans-serif;margin:0;color:#1d2330;background:#f6f7f9}
main{max-width:1280px;margin:0 auto;padding:20px 28px 60px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 10px;border-bottom:1px solid #dde1e7;padding-bottom:4px}
.sub{color:#5b6577;margin-bottom:16px}
.cards{display:flex;flex-wrap:wrap;gap:10px}
.card{background:#fff;border:1px solid #dde1e7;border-radius:8px;padding:8px 14px;min-width:120px}
.card b{display:block;font-size:20px}.card span{color:#5b6577;font-size:12px}
table{border-collapse:collapse;background:#fff;border:1px solid #dde1e7;width:100%;font-size:13px}
th,td{padding:4px 8px;border-bottom:1px solid #eceff3;text-align:left;vertical-align:top}
th{background:#eef1f5;position:sticky;top:0}td.n{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
code{font:12px/1.3 ui-monospace,'DejaVu Sans Mono',monospace}
details summary{cursor:pointer;color:#2456a6}
.graph{background:#fff;border:1px solid #dde1e7;border-radius:8px;overflow:auto;max-height:900px}
.legend{display:flex;flex-wrap:wrap;gap:14px;margin:8px 0;font-size:12px;color:#3b4456}
.sw{display:inline-block;width:12px;height:12px;border-radius:3px;vertical-align:-2px;margin-right:4px;border:1px solid #8892a3}
.note{color:#5b6577;font-size:13px}.warn{background:#fff4e0;border:1px solid #f0c27a;padding:8px 12px;border-radius:6px}
"""


def render(report: Report, title: str | None = None) -> str:
    """The whole page for ``report`` as an HTML string."""
    sub_of = _subprogram_of(report)
    parts = [f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
             f"<title>{escape(title or 'souffle-tvm report: ' + report.model)}</title><style>{CSS}</style></head><body><main>",
             _header(report), measured_html.section(report), _group_section(report, sub_of), _kernel_section(report),
             _boundary_section(report, sub_of), "</main></body></html>"]
    return "\n".join(parts)


def save(report: Report, path: str) -> None:
    """Write :func:`render`'s page to ``path``."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(render(report))


def _subprogram_of(report: Report) -> dict[int, int]:
    """group index -> subprogram index (v3). Reports written before ``indices`` existed are
    matched by position: subprograms cover the groups in order."""
    out, pos = {}, 0
    for s, sp in enumerate(report.subprograms):
        idx = sp.get("indices") or list(range(pos, pos + len(sp["groups"])))
        for i in idx:
            out[i] = s
        pos = max(idx) + 1 if idx else pos
    return out


def _header(r: Report) -> str:
    level = f" · level {escape(r.level)}" if r.level else ""
    res = "ptxas" if r.nvcc.get("available") else f"none ({escape(r.nvcc.get('note', ''))})"
    cards = [("launches / inference", r.launches), ("distinct kernels", r.distinct_kernels),
             ("groups", len(r.groups) or "-"), ("subprograms", len(r.subprograms) or "-"),
             ("traffic", si(r.bytes) + "B"), ("work", si(r.flops) + "FLOP"),
             ("compile", f"{r.compile_seconds:.2f} s"),
             ("grid syncs", sum((k.grid_syncs or 0) * k.launches for k in r.kernels))]
    html = [f"<h1>{escape(r.model)}</h1><div class='sub'>target {escape(r.target)}"
            f"{' (' + escape(r.arch) + ')' if r.arch else ''} · fusion {escape(r.fusion)}{level} · "
            f"resource figures: {res}</div><div class='cards'>"]
    html += [f"<div class='card'><b>{escape(str(v))}</b><span>{escape(k)}</span></div>" for k, v in cards]
    html.append("</div>")
    if r.fallback:
        html.append(f"<p class='warn'>Fell back to TVM's default path: {escape(r.fallback)}</p>")
    return "".join(html)


ROWS_PER_COLUMN = 10      # a long chain inside one kernel wraps into further columns
PAGE_WIDTH = 1220         # clusters wrap into a new band past this width
PAD = 12                  # inside a cluster box, around its nodes
LABEL_H = 20              # a cluster box's title line


def _layer(nodes: list[int], edges: list[list[int]]) -> list[list[int]]:
    """Layers of the sub-DAG on ``nodes`` (in topological order): longest path from a source
    within the sub-DAG; in a layer, nodes sorted by their parents' mean slot (one barycentre
    sweep keeps chains straight)."""
    inside = set(nodes)
    parents: dict[int, list[int]] = {i: [] for i in nodes}
    for a, b in edges:
        if a in inside and b in inside and a < b:   # groups are in topological order
            parents[b].append(a)
    depth: dict[int, int] = {}
    for i in nodes:
        depth[i] = max((depth[p] + 1 for p in parents[i]), default=0)
    layers: list[list[int]] = [[] for _ in range(max(depth.values(), default=-1) + 1)]
    for i in nodes:
        layers[depth[i]].append(i)
    slot: dict[int, float] = {}
    for row in layers:
        row.sort(key=lambda i: (sum(slot[p] for p in parents[i]) / len(parents[i]) if parents[i] else 0.0, i))
        slot.update((i, k) for k, i in enumerate(row))
    return layers


def layout(clusters: list[list[int]], edges: list[list[int]]) -> tuple[dict, list, float, float]:
    """Place each cluster (a kernel's groups) as a box of layered nodes, boxes left to right and
    wrapping into bands. A cluster with more than ``ROWS_PER_COLUMN`` layers continues in a
    further column inside its box. Returns ({node: (x, y)}, [(x, y, w, h) per cluster], width,
    height) with top-left corners."""
    pos: dict[int, tuple[float, float]] = {}
    boxes = []
    x = y = band_h = 0.0
    for nodes in clusters:
        layers = _layer(nodes, edges)
        per_col = min(ROWS_PER_COLUMN, max(len(layers), 1))
        cols = [layers[c:c + per_col] for c in range(0, len(layers), per_col)]
        col_w = [max(len(r) for r in col) * (NODE_W + GAP_X) - GAP_X for col in cols]
        w = sum(col_w) + GAP_X * (len(cols) - 1) + 2 * PAD
        h = per_col * (NODE_H + GAP_Y) - GAP_Y + 2 * PAD + LABEL_H
        if x > 0 and x + w > PAGE_WIDTH:       # wrap to the next band
            x, y, band_h = 0.0, y + band_h + GAP_Y, 0.0
        cx = x + PAD
        for col, cw in zip(cols, col_w):
            for d, row in enumerate(col):
                x0 = cx + (cw - (len(row) * (NODE_W + GAP_X) - GAP_X)) / 2
                for k, i in enumerate(row):
                    pos[i] = (x0 + k * (NODE_W + GAP_X), y + PAD + LABEL_H + d * (NODE_H + GAP_Y))
            cx += cw + GAP_X
        boxes.append((x, y, w, h))
        x += w + GAP_X
        band_h = max(band_h, h)
    width = max((bx + bw for bx, _, bw, _ in boxes), default=0) + 2
    return pos, boxes, width, y + band_h + 2


def clusters_of(report: Report, n: int) -> list[list[int]]:
    """The groups 0..n-1 by kernel: a subprogram's groups at v3; else runs of consecutive
    groups (each its own kernel) so that the picture wraps instead of becoming one tall chain."""
    if report.subprograms:
        sub_of = _subprogram_of(report)
        out: dict[int, list[int]] = {}
        for i in range(n):
            out.setdefault(sub_of.get(i, -1 - i), []).append(i)
        return list(out.values())
    return [list(range(i, min(i + ROWS_PER_COLUMN, n))) for i in range(0, n, ROWS_PER_COLUMN)]


def group_svg(report: Report, sub_of: dict[int, int] | None = None) -> str:
    """The group DAG as inline SVG: one box per group; at v3 the groups of one subprogram
    (= one stitched kernel) sit in one labelled, coloured frame. Edges inside a kernel are grey
    (a barrier inside one launch); edges across a kernel boundary are red dashes (the data goes
    through global memory between launches)."""
    sub_of = _subprogram_of(report) if sub_of is None else sub_of
    n = min(len(report.groups), MAX_GRAPH_NODES)
    edges = [e for e in report.group_edges if e[0] < n and e[1] < n]
    clusters = clusters_of(report, n)
    pos, boxes, width, height = layout(clusters, edges)
    out = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{width:.0f}' height='{height:.0f}' "
           f"viewBox='0 0 {width:.0f} {height:.0f}' font-family='DejaVu Sans, sans-serif' role='img' "
           f"aria-label='kernel group graph'>",
           "<defs><marker id='arr' viewBox='0 0 8 8' refX='7' refY='4' markerWidth='7' markerHeight='7' "
           "orient='auto'><path d='M0,0 L8,4 L0,8 z' fill='#7b8494'/></marker>"
           "<marker id='arr2' viewBox='0 0 8 8' refX='7' refY='4' markerWidth='7' markerHeight='7' "
           "orient='auto'><path d='M0,0 L8,4 L0,8 z' fill='#c0392b'/></marker></defs>"]
    for c, (nodes, (bx, by, bw, bh)) in enumerate(zip(clusters, boxes)):
        s = sub_of.get(nodes[0]) if report.subprograms else None
        if s is not None:
            fill, label = PALETTE[s % len(PALETTE)], f"kernel {s} · {len(nodes)} group{'s' if len(nodes) > 1 else ''}"
        else:
            fill, label = "#f3f5f8", f"groups {nodes[0]}–{nodes[-1]}, a kernel each"
        label = label if len(label) * 7 < bw - PAD else label[:int((bw - PAD) / 7) - 1] + "…"
        out.append(f"<rect x='{bx:.0f}' y='{by:.0f}' width='{bw:.0f}' height='{bh:.0f}' rx='10' fill='{fill}' "
                   f"fill-opacity='0.45' stroke='#9aa3b2'/><text x='{bx + PAD:.0f}' y='{by + 16:.0f}' "
                   f"font-size='12' font-weight='bold' fill='#3b4456'>{escape(label)}</text>")
    from_outside: dict[int, list[int]] = {}
    for a, b in edges:
        (xa, ya), (xb, yb) = pos[a], pos[b]
        cross = sub_of.get(a, -1 - a) != sub_of.get(b, -1 - b)
        if cross and report.subprograms:
            # Arrows between frames would criss-cross the page: name the producers on the node.
            from_outside.setdefault(b, []).append(a)
            continue
        if abs(xa - xb) < 1 and yb > ya:      # same column: straight down
            x1, y1, x2, y2 = xa + NODE_W / 2, ya + NODE_H, xb + NODE_W / 2, yb - 1
            c1, c2 = f"{x1:.0f},{y1 + GAP_Y * .6:.0f}", f"{x2:.0f},{y2 - GAP_Y * .6:.0f}"
        else:                                  # another column or frame: leave right, enter left
            x1, y1, x2, y2 = xa + NODE_W, ya + NODE_H / 2, xb - 1, yb + NODE_H / 2
            c1, c2 = f"{x1 + 40:.0f},{y1:.0f}", f"{x2 - 40:.0f},{y2:.0f}"
        style = ("stroke='#c0392b' stroke-dasharray='5 3' marker-end='url(#arr2)'" if cross
                 else "stroke='#7b8494' marker-end='url(#arr)'")
        out.append(f"<path d='M{x1:.0f},{y1:.0f} C{c1} {c2} {x2:.0f},{y2:.0f}' fill='none' stroke-width='1.3' "
                   f"{style}/>")
    for i in range(n):
        g, (x, y) = report.groups[i], pos[i]
        s = sub_of.get(i)
        opaque = g["reason"].startswith("opaque op")
        label = g["name"] if len(g["name"]) <= 24 else g["name"][:22] + "…"
        detail = f"#{i} · {len(g['members'])} stage{'s' if len(g['members']) != 1 else ''}"   # no markup inside
        tip = f"{g['name']}: {', '.join(g['members'])}\nboundary before it: {g['reason']}"
        fill = PALETTE[s % len(PALETTE)] if s is not None else "#ffffff"
        ins = from_outside.get(i, [])
        if ins:
            more = f" +{len(ins) - 3}" if len(ins) > 3 else ""
            detail += f"</tspan><tspan fill='#c0392b'> · ← {', '.join(f'#{a}' for a in ins[:3])}{more}"
        out.append(f"<g><title>{escape(tip)}</title><rect x='{x:.0f}' y='{y:.0f}' width='{NODE_W}' height='{NODE_H}' "
                   f"rx='6' fill='{fill}' stroke='{'#444' if opaque else '#8892a3'}' "
                   f"stroke-dasharray='{'4 2' if opaque else 'none'}'/>"
                   f"<text x='{x + 8:.0f}' y='{y + 16:.0f}' font-size='12' fill='#1d2330'>{escape(label)}</text>"
                   f"<text x='{x + 8:.0f}' y='{y + 31:.0f}' font-size='10' fill='#5b6577'><tspan>{detail}</tspan></text>"
                   + (f"<path d='M{x - 7:.0f},{y + 12:.0f} L{x:.0f},{y + 19:.0f} L{x - 7:.0f},{y + 26:.0f} z' "
                      "fill='#c0392b'/>" if ins else "") + "</g>")
    out.append("</svg>")
    return "".join(out)


def _group_section(r: Report, sub_of: dict[int, int]) -> str:
    if not r.groups:
        why = (f"the Souffle pipeline fell back to TVM: {r.fallback}" if r.fallback else
               "this report is from TVM's own fusion; compile with <code>--fusion souffle</code> to see the groups")
        return f"<h2>Kernel groups</h2><p class='note'>No group graph: {why}.</p>"
    html = ["<h2>Kernel groups and where the kernels end</h2>",
            "<p class='note'>Each box is a kernel group (an anchor stage with the stages fused into it). "
            + ("Boxes of one colour are one subprogram, stitched into one cooperative kernel. "
               if r.subprograms else "At this level every group is its own kernel. ")
            + ("Grey arrows stay inside a kernel (a barrier orders them); a red ◀ and “← #i” mark data "
               "that group reads from another kernel through global memory. " if r.subprograms else
               "Red dashed arrows cross a kernel boundary (the data goes through global memory). ")
            + 
              "Hover a box for its stages and the reason for the boundary before it.</p>"]
    if len(r.groups) > MAX_GRAPH_NODES:
        html.append(f"<p class='note'>Showing the first {MAX_GRAPH_NODES} of {len(r.groups)} groups; "
                    "the table below lists all.</p>")
    html.append(f"<div class='graph'>{group_svg(r, sub_of)}</div>")
    return "".join(html)


def _kernel_section(r: Report) -> str:
    rows = []
    for k in sorted(r.kernels, key=lambda k: -k.launches * max(k.bytes, 1)):
        intensity = f"{k.flops / k.bytes:.1f}" if k.bytes else "-"
        coop = ""
        if k.cooperative:
            coop = "cooperative" + (f", ≤{k.max_coresident} blocks co-resident" if k.max_coresident else "")
        stages = ""
        if k.stages:
            stages = (f"<details><summary>{len(k.stages)} stages</summary><code>"
                      + "<br>".join(escape(s) for s in k.stages) + "</code></details>")
        rows.append(
            f"<tr><td><code>{escape(k.name)}</code>{'<br><span class=note>' + coop + '</span>' if coop else ''}"
            f"{stages}</td><td class=n>{k.launches}</td><td class=n>{dims(k.grid)}</td><td class=n>{dims(k.block)}</td>"
            f"<td class=n>{_opt(k.registers)}</td><td class=n>{_opt(k.shared_bytes)}</td>"
            f"<td class=n>{_opt(k.spill_bytes)}</td><td class=n>{_opt(k.grid_syncs)}</td>"
            f"<td class=n>{si(k.bytes)}</td><td class=n>{si(k.flops)}</td><td class=n>{intensity}</td></tr>")
    return ("<h2>Kernels</h2><p class='note'>Per launch, ordered by launches × bytes. Registers and shared "
            "memory (bytes) come from ptxas; bytes are the compulsory global traffic of one launch; flops "
            "count a multiply-add as two; intensity = flops / byte.</p>"
            "<table><thead><tr><th>kernel</th><th>calls</th><th>grid</th><th>block</th><th>regs</th>"
            "<th>smem</th><th>spill</th><th>grid syncs</th><th>bytes</th><th>flops</th><th>intensity</th>"
            "</tr></thead><tbody>" + "".join(rows) + "</tbody></table>")


def reason_key(reason: str) -> str:
    """A boundary reason without its details (what follows ':' or '('), for counting kinds."""
    return reason.split(":")[0].split("(")[0].strip()


def _bars(items: list[dict], title: str) -> str:
    """Inline SVG bar chart: how many boundaries each kind of reason drew."""
    counts = Counter(reason_key(it["reason"]) for it in items).most_common()
    if not counts:
        return ""
    top, w, row = counts[0][1], 360, 22
    svg = [f"<svg xmlns='http://www.w3.org/2000/svg' width='980' height='{row * len(counts) + 8}' "
           f"font-family='DejaVu Sans, sans-serif' font-size='12' role='img' aria-label='{escape(title)}'>"]
    for i, (reason, n) in enumerate(counts):
        y = 4 + i * row
        svg.append(f"<rect x='0' y='{y}' width='{max(2, w * n / top):.0f}' height='{row - 6}' rx='3' fill='#6c8ebf'/>"
                   f"<text x='{w + 8}' y='{y + 12}' fill='#1d2330'>{n} × {escape(reason[:90])}</text>")
    svg.append("</svg>")
    return f"<p><b>{escape(title)}</b></p>" + "".join(svg)


def _boundary_section(r: Report, sub_of: dict[int, int]) -> str:
    if not r.groups:
        return ""
    html = ["<h2>Why each boundary was drawn</h2>",
            _bars(r.groups, "Group boundaries (a group starts a new kernel at v0–v2)")]
    if r.subprograms:
        html.append(_bars(r.subprograms, "Subprogram ends (where a stitched kernel stops)"))
        stitched = {k.primfunc: k.name for k in r.kernels}
        # the stitcher names subprogram s's kernel souffle_stitched_<s>; a one-group subprogram
        # is that group's own (unstitched) kernel
        names = [stitched.get(f"souffle_stitched_{s}", "its group's own kernel") for s in range(len(r.subprograms))]
        rows = "".join(f"<tr><td class=n>{s}</td><td><code>{escape(names[s])}</code></td><td class=n>{len(sp['groups'])}</td>"
                       f"<td><code>{escape(', '.join(sp['groups'][:8]))}{' …' if len(sp['groups']) > 8 else ''}"
                       f"</code></td><td>{escape(sp['reason'])}</td></tr>" for s, sp in enumerate(r.subprograms))
        html.append("<p><b>Subprograms</b></p><table><thead><tr><th>kernel</th><th>CUDA function</th><th>groups</th><th>first groups</th>"
                    f"<th>why it ends here</th></tr></thead><tbody>{rows}</tbody></table>")
    rows = "".join(f"<tr><td class=n>{i}</td><td><code>{escape(g['name'])}</code></td>"
                   f"<td class=n>{'-' if sub_of.get(i) is None else sub_of[i]}</td>"
                   f"<td><details><summary>{len(g['members'])}</summary><code>{escape(', '.join(g['members']))}"
                   f"</code></details></td><td>{escape(g['reason'])}</td></tr>" for i, g in enumerate(r.groups))
    html.append("<p><b>Groups</b></p><table><thead><tr><th>#</th><th>group</th><th>kernel</th><th>stages</th>"
                f"<th>boundary before it</th></tr></thead><tbody>{rows}</tbody></table>")
    return "".join(html)


def _opt(x) -> str:
    return "-" if x is None else str(x)
