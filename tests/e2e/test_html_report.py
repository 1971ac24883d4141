"""``ddpdoctor report --format html``: a self-contained page, checked as text and rendered in
headless Chromium (DOM and screenshot), on a real divergent-branch run and on hand-made traces."""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
import zlib
from html.parser import HTMLParser
from pathlib import Path

import pytest
from support.jobs import report
from support.timeline_runs import divergent_run
from support.traces import site_record as site
from support.traces import timed_coll as coll
from support.traces import write_rank

from ddpdoctor.analysis.engine import analyze
from ddpdoctor.analysis.run import load_run
from ddpdoctor.render import html_report as render_html

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--no-first-run", "--disable-sync"]


def _chromium() -> str | None:
    for name in ("/usr/bin/chromium", shutil.which("chromium"), shutil.which("chromium-browser")):
        if name and Path(name).exists():
            return name
    return None


@pytest.fixture(scope="module")
def chromium() -> str:
    exe = _chromium()
    if exe is None and shutil.which("apt-get"):
        # Debian's package; the Makefile's test target tries the same before the suite.
        try:
            subprocess.run("apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium",
                           shell=True, capture_output=True, timeout=240)
        except subprocess.TimeoutExpired:
            pass
        exe = _chromium()
    if exe is None:
        pytest.skip("headless Chromium is not installed and could not be installed (apt-get install chromium)")
    return exe


def run_chromium(exe: str, tmp: Path, page: Path, *args: str) -> subprocess.CompletedProcess:
    profile = tmp / f"profile-{len(list(tmp.glob('profile-*')))}"
    return subprocess.run([exe, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args, page.as_uri()],
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def divergent_html(tmp_path_factory) -> Path:
    trace_dir = divergent_run(tmp_path_factory)
    out = tmp_path_factory.mktemp("html") / "report.html"
    res = report(trace_dir, "--format", "html", "-o", out)
    assert res.returncode == 1, res.stderr  # an error finding
    assert out.exists()
    return out


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


def _no_external_loads(page: str) -> None:
    """Parsed as a browser would: no element or attribute that runs code or loads anything."""
    assert page.startswith("<!DOCTYPE html>")
    assert "Content-Security-Policy" in page and "default-src 'none'" in page
    parser = _Tags()
    parser.feed(page)
    for tag, attrs in parser.tags:
        assert tag not in ("script", "link", "iframe", "object", "embed", "img", "image", "use", "a",
                           "form", "base", "audio", "video", "source"), tag
        for name in attrs:
            assert name not in ("src", "href", "xlink:href", "srcset", "action") and not name.startswith("on"), \
                (tag, name)
    assert "@import" not in page and "url(" not in page
    # The only URL is the SVG namespace name, which is never fetched.
    assert set(re.findall(r"https?://[^\s\"'<>]+", page)) <= {"http://www.w3.org/2000/svg"}


def lane_labels(svg: str) -> list[str]:
    """The swimlane's lanes, top to bottom (each lane's label group has the full rank list)."""
    return re.findall(r"<g><title>(ranks? [^<:]*)</title>", svg)


def test_page_is_self_contained_and_shows_the_finding(divergent_html):
    page = divergent_html.read_text(encoding="utf-8")
    _no_external_loads(page)
    assert "DD001" in page and "divergent-collectives" in page
    # Source lines of both sides and the condition, and the fix.
    assert "dist.all_reduce(torch.zeros(1))" in page and "dist.barrier()" in page
    assert "if rank == 0:" in page
    assert "Make every rank of the group issue the same collectives" in page
    # The swimlane: one lane per rank, calls #1-#4, the diverging column and calls highlighted.
    (svg,) = re.findall(r"<svg.*?</svg>", page, flags=re.S)
    assert lane_labels(svg) == ["rank 0", "rank 1"]
    assert [f"#{i}" for i in range(1, 5)] == re.findall(r">(#\d+)</text>", svg)
    assert svg.count('stroke="#c62828" stroke-width="3"') == 2  # rank 0's all_reduce, rank 1's barrier
    assert ">barrier</text>" in svg and svg.count(">all_reduce</text>") == 7
    assert "float32[1]" in svg and "raised after" in svg


def test_chromium_renders_the_page(divergent_html, chromium, tmp_path):
    res = run_chromium(chromium, tmp_path, divergent_html, "--dump-dom")
    assert res.returncode == 0, res.stderr[-2000:]
    dom = res.stdout
    assert "ddpdoctor report" in dom and "DD001" in dom
    assert "Ranks issue different collectives" in dom
    assert "rank 0" in dom and "rank 1" in dom and "<svg" in dom
    png = tmp_path / "report.png"
    res = run_chromium(chromium, tmp_path, divergent_html, f"--screenshot={png}", "--window-size=1400,1800")
    assert res.returncode == 0 and png.exists(), res.stderr[-2000:]
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (1400, 1800)
    # A blank page's screenshot is about 12 KB here; this page's is over 100 KB.
    assert len(data) > 40_000, len(data)
    assert _distinct_colours(data) > 50


def _distinct_colours(png: bytes, rows: int = 600) -> int:
    """Distinct RGB(A) colours in the first rows of a non-interlaced 8-bit PNG (no Pillow here)."""
    pos, idat, ihdr = 8, b"", None
    while pos < len(png):
        n, kind = struct.unpack(">I4s", png[pos:pos + 8])
        body = png[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            ihdr = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    width, _h, depth, ctype, _c, _f, interlace = ihdr
    assert depth == 8 and interlace == 0 and ctype in (2, 6)
    bpp = 3 if ctype == 2 else 4
    raw = zlib.decompress(idat)
    stride = width * bpp
    prev = bytearray(stride)
    colours = set()
    for y in range(rows):
        ftype = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b = prev[i]
            c = prev[i - bpp] if i >= bpp else 0
            if ftype == 1:
                line[i] = (line[i] + a) & 255
            elif ftype == 2:
                line[i] = (line[i] + b) & 255
            elif ftype == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif ftype == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        colours.update(bytes(line[i:i + 3]) for i in range(0, stride, bpp))
        prev = line
    return len(colours)


def _evil_run(tmp_path):
    evil_file = "/src/<script>alert(1)</script>.py"
    evil_src = '<img src=x onerror="alert(2)"> if rank == 0: dist.all_reduce(x)'
    conds = [[evil_file, 5, "if rank == 0:", "if"]]
    d = tmp_path / "t"
    write_rank(d, 0, 2, [site(1), site(2, file=evil_file, line=6, src=evil_src, conds=conds),
                         coll("all_reduce", 1, 100, 10), coll("all_reduce", 2, 200, 10, sid=2,
                                                              err="RuntimeError: <b>boom</b>")])
    write_rank(d, 1, 2, [site(1), site(3, line=7, src="dist.barrier()"), coll("all_reduce", 1, 100, 10),
                         coll("barrier", 2, 200, 10, sid=3)])
    run = load_run([str(d)])
    findings, notes = analyze(run)
    assert any(f.id == "DD001" for f in findings)
    return render_html.render(run, findings, notes)


def test_untrusted_trace_text_is_escaped(tmp_path):
    page = _evil_run(tmp_path)
    _no_external_loads(page)
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "&lt;img src=x onerror=&quot;alert(2)&quot;&gt;" in page
    assert "&lt;b&gt;boom&lt;/b&gt;" in page  # the exception text, in the swimlane's tooltip


def test_untrusted_trace_text_stays_text_in_the_browser(chromium, tmp_path):
    """The browser's DOM of a page built from a trace full of markup: no element came from it."""
    page = tmp_path / "evil.html"
    page.write_text(_evil_run(tmp_path), encoding="utf-8")
    res = run_chromium(chromium, tmp_path, page, "--dump-dom")
    assert res.returncode == 0, res.stderr[-2000:]
    dom = res.stdout
    assert "ddpdoctor report" in dom
    assert "<script" not in dom.lower() and "<img" not in dom.lower() and "<b>boom" not in dom
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in dom


def test_identical_ranks_share_a_lane_and_clean_runs_say_so(tmp_path):
    d = tmp_path / "t"
    world = 6
    for r in range(world):
        recs = [site(1), coll("all_reduce", 1, 100, 10), coll("all_reduce", 2, 200, 10)]
        recs.append(coll("broadcast", 3, 300, 10, root=0) if r == 4 else coll("barrier", 3, 300, 10))
        write_rank(d, r, world, recs)
    run = load_run([str(d)])
    findings, notes = analyze(run)
    (div,) = [f for f in findings if f.id == "DD001"]
    page = render_html.render(run, findings, notes)
    (svg,) = re.findall(r"<svg.*?</svg>", page, flags=re.S)
    assert lane_labels(svg) == ["ranks 0-3,5", "rank 4"]
    assert ">5 ranks</text>" in svg
    assert "culprit" in svg and 4 in div.ranks
    clean = tmp_path / "clean"
    for r in range(2):
        write_rank(clean, r, 2, [site(1), coll("all_reduce", 1, 100, 10)])
    run = load_run([str(clean)])
    findings, notes = analyze(run)
    page = render_html.render(run, findings, notes)
    assert "No findings" in page and "<svg" not in page
