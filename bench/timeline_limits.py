"""How big do ``ddpdoctor timeline`` files get, how fast are they written, and can a browser read them?

    .venv/bin/python bench/timeline_limits.py --ranks 8 --events 50000 [--chromium]

Writes synthetic rank files (no torch needed: the trace format is plain JSON Lines), times
``timeline.write`` on them, and with ``--chromium`` loads the result in headless Chromium the way
chrome://tracing does (the whole file as one string, then ``JSON.parse``). The figures in
docs/timeline-and-html.md come from this script.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ddpdoctor.render import timeline  # noqa: E402


def make_traces(out: str, ranks: int, events: int) -> None:
    """``ranks`` rank files of ``events`` all_reduce calls each, 1 ms apart."""
    os.makedirs(out, exist_ok=True)
    wall0 = time.time()
    for r in range(ranks):
        path = os.path.join(out, f"rank{r:05d}-bench-{1000 + r}-a0.jsonl")
        with open(path, "w") as f:
            f.write(json.dumps({"t": "header", "schema": 1, "run": "bench", "rank": r, "world": ranks,
                                "host": "bench", "pid": 1000 + r, "attempt": 0, "backend": "gloo",
                                "torch": "n/a", "wall0": wall0 + r * 1e-4}) + "\n")
            f.write(json.dumps({"t": "site", "id": 1, "file": "/src/train.py", "line": 42,
                                "func": "train_step", "src": "dist.all_reduce(loss)", "stack": [],
                                "conds": []}) + "\n")
            for i in range(events):
                f.write(f'{{"t":"c","op":"all_reduce","g":"0","s":{i + 1},"x":["float32[1024]"],'
                        f'"n":1024,"rop":"SUM","ts":{1000 * i + 10},"d":{200 + (i * 7919 + r) % 700},'
                        f'"site":1}}\n')
            f.write(json.dumps({"t": "exit", "how": "normal", "ts": 1000 * events + 500}) + "\n")


_PAGE = """<!DOCTYPE html><html><body><pre id="out">loading</pre><script>
var out = document.getElementById('out'), t0 = performance.now();
try {
  var x = new XMLHttpRequest(); x.open('GET', %s, false); x.send();
  var text = x.responseText, t1 = performance.now();
  var doc = JSON.parse(text), t2 = performance.now();
  out.textContent = 'OK events=' + doc.traceEvents.length + ' chars=' + text.length +
    ' read_ms=' + Math.round(t1 - t0) + ' parse_ms=' + Math.round(t2 - t1);
} catch (e) { out.textContent = 'FAIL ' + e; }
</script></body></html>"""


def chromium_parse(path: str, timeout: float = 300) -> str:
    """Read and JSON.parse the file in headless Chromium; returns its one-line verdict."""
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        return "chromium not installed"
    with tempfile.TemporaryDirectory() as tmp:
        page = os.path.join(tmp, "load.html")
        with open(page, "w") as f:
            f.write(_PAGE % json.dumps("file://" + os.path.abspath(path)))
        cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--no-first-run", "--disable-sync",
               "--allow-file-access-from-files", f"--user-data-dir={tmp}/profile",
               "--virtual-time-budget=600000", "--dump-dom", "file://" + page]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return f"timed out after {timeout:.0f} s"
    m = re.search(r'<pre id="out">(.*?)</pre>', res.stdout)
    if m:
        return m.group(1)
    return f"no verdict (exit {res.returncode}; the renderer probably ran out of memory)"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--events", type=int, default=50000, help="calls per rank")
    ap.add_argument("--chromium", action="store_true")
    ap.add_argument("--keep", default=None, help="keep the files in this folder")
    a = ap.parse_args()
    tmp = a.keep or tempfile.mkdtemp(prefix="ddpdoctor-tl-")
    try:
        traces = os.path.join(tmp, "traces")
        make_traces(traces, a.ranks, a.events)
        in_bytes = sum(os.path.getsize(os.path.join(traces, n)) for n in os.listdir(traces))
        out = os.path.join(tmp, "timeline.json")
        t0 = time.perf_counter()
        n = timeline.write([traces], out)
        dt = time.perf_counter() - t0
        size = os.path.getsize(out)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"ranks={a.ranks} calls/rank={a.events} trace_MB={in_bytes / 1e6:.1f} events={n} "
              f"timeline_MB={size / 1e6:.1f} bytes/event={size / max(n, 1):.0f} write_s={dt:.1f} "
              f"({n / dt:,.0f} events/s) peak_rss_MB={rss:.0f}", flush=True)
        if a.chromium:
            t0 = time.perf_counter()
            verdict = chromium_parse(out)
            print(f"chromium: {verdict} (wall {time.perf_counter() - t0:.1f} s)", flush=True)
    finally:
        if not a.keep:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
