"""The HTML report: built from a real v3 compile, checked as markup, as geometry, and in Chromium."""

import shutil
import subprocess
from html.parser import HTMLParser

import numpy as np
import pytest

from souffle_tvm.report import html as report_html
from souffle_tvm.pipeline.driver import compile as compile_model
from souffle_tvm.report.schema import Report

CHROMIUM = next((p for p in ("chromium", "chromium-browser", "google-chrome") if shutil.which(p)), None)


@pytest.fixture(scope="module")
def v3():
    """BERT (small) at v3 for CUDA: one stitched kernel, 18 groups with reasons, a group DAG."""
    return compile_model("bert", "cuda", "souffle", small=True, level="v3")


@pytest.fixture(scope="module")
def v2():
    return compile_model("mmoe", "llvm", "souffle", small=True)


def test_group_edges_are_the_dag_the_groups_read(v3):
    r = v3.report
    assert r.group_edges, "a 2-layer BERT has producer/consumer groups"
    n = len(r.groups)
    for a, b in r.group_edges:
        assert 0 <= a < b < n                       # groups are in topological order
    # every group but the first reads some earlier group (BERT is one connected chain of layers)
    consumers = {b for _, b in r.group_edges}
    assert consumers == set(range(1, n))
    assert sorted(i for sp in r.subprograms for i in sp["indices"]) == list(range(n))


class _Collect(HTMLParser):
    """Tags and attributes, and whether every opened element was closed in order."""

    VOID = {"meta", "br", "path", "rect", "marker", "img", "link", "input"}

    def __init__(self):
        super().__init__()
        self.stack, self.tags, self.attrs, self.errors = [], [], [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.attrs += attrs
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.tags.append(tag)
        self.attrs += attrs

    def handle_endtag(self, tag):
        if tag in self.VOID:
            return
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:]}")
        else:
            self.stack.pop()


def test_page_is_self_contained_and_complete(v3):
    r = v3.report
    page = report_html.render(r)
    p = _Collect()
    p.feed(page)
    assert not p.errors and not p.stack, (p.errors, p.stack)
    # nothing fetched from anywhere: no scripts, stylesheets, images or remote URLs
    assert "script" not in p.tags and "link" not in p.tags and "img" not in p.tags
    assert not [v for k, v in p.attrs if k in ("src", "href") and v and not v.startswith("#")]
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "") and "https://" not in page
    for k in r.kernels:
        assert k.name in page
        for st in k.stages or []:
            assert st in page
    for g in r.groups:
        assert g["reason"].replace("'", "&#x27;") in page
    for sp in r.subprograms:
        assert sp["reason"] in page
    svg = page[page.index("<svg"):page.index("</svg>")]
    assert svg.count("<title>") == len(r.groups)            # one box (with tooltip) per group
    k = r.kernels[0]
    # at most a grid sync between stages (a two-phase partial after its GEMM needs only a block barrier)
    assert f"<td class=n>{k.grid_syncs}</td>" in page and 0 < k.grid_syncs <= len(k.stages) - 1


def test_layout_places_every_group_without_overlap(v3, v2):
    for rep in (v3.report, v2.report):
        n = len(rep.groups)
        clusters = report_html.clusters_of(rep, n)
        assert sorted(i for c in clusters for i in c) == list(range(n))
        pos, boxes, width, height = report_html.layout(clusters, rep.group_edges)
        xy = np.array([pos[i] for i in range(n)])
        assert (xy >= 0).all() and (xy[:, 0] + report_html.NODE_W <= width).all()
        assert (xy[:, 1] + report_html.NODE_H <= height).all()
        for i in range(n):
            for j in range(i + 1, n):
                dx, dy = abs(xy[i] - xy[j])
                assert dx >= report_html.NODE_W or dy >= report_html.NODE_H, (i, j)
        # every node inside its cluster's frame; producers above consumers within a column
        for c, (bx, by, bw, bh) in zip(clusters, boxes):
            for i in c:
                x, y = pos[i]
                assert bx <= x and x + report_html.NODE_W <= bx + bw and by <= y and y + report_html.NODE_H <= by + bh
        for a, b in rep.group_edges:
            if pos[a][0] == pos[b][0] and any(a in c and b in c for c in clusters):
                assert pos[a][1] < pos[b][1]


def test_tvm_report_and_old_reports_render(tmp_path, v2):
    tvm_report = compile_model("mmoe", "llvm", "tvm", small=True).report
    page = report_html.render(tvm_report)
    assert "No group graph" in page and "--fusion souffle" in page
    # a report saved before group_edges / subprogram indices existed still loads and renders
    data = v2.report.to_json()
    del data["group_edges"]
    data["added_by_a_newer_version"] = {"x": 1}              # and one from a newer version loads too
    data["kernels"][0]["future_field"] = 3
    path = tmp_path / "old.json"
    path.write_text(__import__("json").dumps(data))
    page = report_html.render(Report.load(str(path)))
    assert page.count("<title>") == 1 + len(v2.report.groups)    # the page's title + one per group


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (`make install` as root installs it via apt)")
def test_headless_chromium_renders_the_page(tmp_path, v3):
    import matplotlib.image

    html = tmp_path / "r.html"
    report_html.save(v3.report, str(html))
    png = tmp_path / "r.png"
    proc = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           f"--screenshot={png}", "--window-size=1280,1600", html.as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert png.exists(), proc.stderr[-2000:]
    img = matplotlib.image.imread(str(png))
    assert img.shape[:2] == (1600, 1280)
    # Not blank, and the subprogram frame colour (PALETTE[0]) is actually painted somewhere.
    assert img[..., :3].std() > 0.05
    frame = np.array([int(report_html.PALETTE[0][i:i + 2], 16) / 255 for i in (1, 3, 5)])
    assert (np.abs(img[..., :3] - frame).max(axis=-1) < 0.02).sum() > 500
