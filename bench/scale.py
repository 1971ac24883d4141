"""Figure 4: the report's time and memory on synthetic traces of 8 to 1024 ranks.

Each folder is generated (``bench/synth.py``) into a temporary directory, reported on by
``python -m ddpdoctor report DIR --format json`` in a child process, and deleted. Time is the
child's wall time (interpreter start-up included); memory is the child's peak RSS from
``wait4`` (the largest single process: the report or one of its reader workers) and the peak of
the whole process tree's RSS sampled every 20 ms. The report must find every injected bug.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import threading
import time

from . import synth
from .common import PY, ROOT, Row, loadavg, plain_env

RATE_TARGET = 500_000  # events per second
LINEAR_TOLERANCE = 1.5  # per-event time at the largest size vs at 64 x 20k
MEMORY_TOLERANCE = 1.25  # peak RSS at 4x the events per rank
BYTES_PER_EVENT = 125  # synthetic traces, for the disk-space check
_DISK_MARGIN = 4 << 30


def _tree_rss(pid: int) -> int:
    import psutil

    try:
        p = psutil.Process(pid)
        procs = [p] + p.children(recursive=True)
    except psutil.Error:
        return 0
    total = 0
    for q in procs:
        try:
            total += q.memory_info().rss
        except psutil.Error:
            pass
    return total


def report(folder: str, timeout: float = 900) -> dict:
    """Run the report in a child process: wall time, CPU time, peak RSS, its JSON."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([PY, "-m", "ddpdoctor", "report", folder, "--format", "json"], env=plain_env(),
                            cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    chunks: dict[str, bytes] = {}
    peak = [0]
    done = threading.Event()

    def drain(name: str, stream) -> None:
        chunks[name] = stream.read()

    def sample() -> None:
        while not done.wait(0.02):
            peak[0] = max(peak[0], _tree_rss(proc.pid))

    threads = [threading.Thread(target=drain, args=("out", proc.stdout), daemon=True),
               threading.Thread(target=drain, args=("err", proc.stderr), daemon=True),
               threading.Thread(target=sample, daemon=True)]
    for t in threads:
        t.start()
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    try:
        _pid, status, ru = os.wait4(proc.pid, 0)
    finally:
        timer.cancel()
        done.set()
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    for t in threads:
        t.join(timeout=10)
    out = {"wall_s": wall, "cpu_s": ru.ru_utime + ru.ru_stime, "maxrss_mb": ru.ru_maxrss / 1024,
           "tree_peak_mb": peak[0] / 2**20, "exit": proc.returncode}
    try:
        out["doc"] = json.loads(chunks.get("out", b"") or b"{}")
    except ValueError:
        out["doc"] = {}
        out["stderr"] = chunks.get("err", b"").decode(errors="replace")[-2000:]
    return out


def found(doc: dict, p: dict) -> dict[str, bool]:
    """Which injected bugs the report found (and whether it wrongly flagged the ordered file)."""
    fs = doc.get("findings") or []
    div, race, hang = p["divergence"], p["race"], p["hang"]
    got = {
        "divergence": any(f["id"] == "DD001" and f["data"].get("seq") == div["seq"]
                          and str(f["data"].get("group")) == div["group"] and div["rank"] in f["ranks"]
                          for f in fs),
        "file race": any(f["id"] == "DD003" and race["path"] in (f["data"].get("paths") or [f["data"].get("path")])
                         for f in fs),
        "hang": any(f["id"] == "DD009" and (f["data"].get("diagnosis") or {}).get("seq") == hang["seq"]
                    and hang["rank"] in f["ranks"] for f in fs),
    }
    got["no false missing-barrier"] = not any(
        f["id"] == "DD003" and p["ordered"]["path"] in (f["data"].get("paths") or [f["data"].get("path")])
        for f in fs)
    return got


def measure(ranks: int, events: int, base: str, log=print) -> dict:
    folder = tempfile.mkdtemp(prefix=f"synth-{ranks}x{events}-", dir=base)
    try:
        p = synth.write(folder, ranks, events)
        la = loadavg()
        r = report(folder)
        doc = r.pop("doc")
        total = ranks * events
        res = {"ranks": ranks, "events_per_rank": events, "total_events": total, "bytes": p["bytes"],
               "gen_s": p["seconds"], "loadavg": la, **r, "events_per_s": total / r["wall_s"],
               "found": found(doc, p), "finding_ids": sorted({f["id"] for f in doc.get("findings") or []})}
        log(f"  {ranks:5d} ranks x {events:6d} events ({p['bytes'] / 2**20:7.0f} MB, generated in "
            f"{p['seconds']:4.0f} s): report {r['wall_s']:6.2f} s wall, {r['cpu_s']:6.2f} s CPU, "
            f"{res['events_per_s']:9.0f} events/s, peak RSS {r['maxrss_mb']:.0f} MB (tree "
            f"{r['tree_peak_mb']:.0f} MB); found: "
            + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in res["found"].items()))
        return res
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _fits(ranks: int, events: int, base: str) -> bool:
    return ranks * events * BYTES_PER_EVENT + _DISK_MARGIN < shutil.disk_usage(base).free


def run(quick: bool, log=print, base: str | None = None) -> tuple[list[Row], dict]:
    base = base or tempfile.gettempdir()
    ev = 2000 if quick else 20000
    sizes = [8, 64, 256] if quick else [8, 64, 256, 1024]
    mem_small = ev // 4
    results, notes = [], []
    for n in sizes:
        m = n
        while not _fits(m, ev, base) and m > 8:
            m //= 2
        if m != n:
            notes.append(f"{n} x {ev} does not fit on {base}'s disk: measured {m} x {ev} instead")
            log("  " + notes[-1])
        results.append(measure(m, ev, base, log))
    small = measure(64, mem_small, base, log)
    big = next(r for r in results if r["ranks"] == 64)
    rows = []
    all_found = all(all(r["found"].values()) for r in results + [small])
    for r in results:
        rows.append(Row("4", f"report, {r['ranks']} ranks x {r['events_per_rank']} events",
                        f"{r['events_per_s'] / 1000:.0f}k events/s", f">= {RATE_TARGET // 1000}k events/s",
                        r["events_per_s"] >= RATE_TARGET,
                        f"{r['wall_s']:.2f} s wall ({r['cpu_s']:.1f} s CPU), peak RSS {r['maxrss_mb']:.0f} MB "
                        f"(process tree {r['tree_peak_mb']:.0f} MB), {r['bytes'] / 2**20:.0f} MB of traces; bugs "
                        + ("all found" if all(r["found"].values()) else
                           "MISSED: " + ", ".join(k for k, v in r["found"].items() if not v)),
                        r["events_per_s"], r))
    largest = results[-1]
    lin = (largest["wall_s"] / largest["total_events"]) / (big["wall_s"] / big["total_events"])
    rows.append(Row("4", f"time linear in events: per-event time at {largest['ranks']}x{ev} vs 64x{ev}",
                    f"{lin:.2f}x", f"<= {LINEAR_TOLERANCE}x", lin <= LINEAR_TOLERANCE,
                    ", ".join(f"{r['ranks']}r: {r['wall_s'] / r['total_events'] * 1e6:.2f} µs/event"
                              for r in results), lin))
    mem = big["maxrss_mb"] / small["maxrss_mb"]
    rows.append(Row("4", f"peak memory, 64 ranks x {ev} vs x {mem_small} events",
                    f"{mem:.2f}x", f"<= {MEMORY_TOLERANCE}x", mem <= MEMORY_TOLERANCE,
                    f"{small['maxrss_mb']:.0f} MB -> {big['maxrss_mb']:.0f} MB (process tree "
                    f"{small['tree_peak_mb']:.0f} -> {big['tree_peak_mb']:.0f} MB) for 4x the events per rank",
                    mem))
    rows.append(Row("4", "injected bugs found (divergence, file race, hang; no false race)",
                    "all found" if all_found else "MISSED", "all", all_found,
                    f"{len(results) + 1} folders checked", None))
    if notes:
        rows[-1].notes += "; " + "; ".join(notes)
    return rows, {"results": results, "memory_small": small, "notes": notes}
