"""Figure 3: from the start of a hang to the printed diagnosis, for 2 to 16 ranks.

``ddpdoctor trace --hang-timeout T --on-hang kill -- torchrun --nproc_per_node=N bench/hangprog.py``
(a divergent branch). The hang starts when the *last* rank enters its diverging call: each rank's
entry time comes from its trace (the watchdog's ``pending`` record, or the in-flight calls of its
``exit`` record), as ``header.wall0 + ts``. The diagnosis time is taken here: when the
``ddpdoctor: HANG`` line reaches the launcher's stderr, and when ``hang-N.txt`` appears.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time

from ddpdoctor.analysis.load import iter_records

from .common import BENCH, PY, ROOT, Row, kill_group, loadavg, median, plain_env, torchrun

SLACK_S = 3.0  # target: diagnosis within hang timeout + this
_VERDICT = re.compile(r"ddpdoctor: (HANG|STALL|SLOW COLLECTIVE)")


def hang_start(trace_dir: str) -> tuple[float | None, dict]:
    """Wall-clock time at which the last rank entered its last (hung) call in group 0."""
    entries: dict[int, tuple[int, float]] = {}
    for path in glob.glob(os.path.join(trace_dir, "rank*.jsonl")):
        wall0, rank, best = None, None, None
        for rec in iter_records(path):
            t = rec.get("t")
            cands = []
            if t == "header":
                wall0, rank = float(rec["wall0"]), int(rec["rank"])
            elif t == "pending" and rec.get("g") == "0":
                cands.append((rec["s"], rec["ts"]))
            elif t == "exit":
                cands += [(i[2], i[4]) for i in rec.get("inflight") or [] if len(i) >= 5 and i[1] == "0"]
            elif t == "hang" and rec.get("role") in ("member", "reporter"):
                st = rec.get("status") or {}
                if st.get("state") == "collective" and st.get("g") == "0":
                    cands.append((st["s"], rec["ts"] - int(float(st.get("since_s", 0)) * 1e6)))
            for s, ts in cands:
                if best is None or s > best[0] or (s == best[0] and ts < best[1]):
                    best = (s, ts)
        if wall0 is not None and best is not None:
            entries[rank] = (best[0], wall0 + best[1] / 1e6)
    if not entries:
        return None, {}
    return max(t for _, t in entries.values()), {str(r): e for r, e in sorted(entries.items())}


def run_case(nproc: int, hang_timeout: float, timeout: float = 240) -> dict:
    out = tempfile.mkdtemp(prefix="ddpdoctor-bench-hang-")
    cmd = [PY, "-m", "ddpdoctor", "trace", "--out", out, "--hang-timeout", str(hang_timeout),
           "--on-hang", "kill", "--no-report", "--",
           *torchrun(nproc, BENCH / "hangprog.py", "--pg-timeout", "600")]
    res: dict = {"ranks": nproc}
    t_line: list[float] = []
    tail: list[str] = []
    proc = subprocess.Popen(cmd, env=plain_env(), cwd=str(ROOT), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)

    def read_stderr() -> None:
        for line in proc.stderr:
            if not t_line and _VERDICT.search(line):
                t_line.append(time.time())
                res["verdict_line"] = line.strip()
            tail.append(line)
            del tail[:-40]

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    t_file = None
    deadline = time.monotonic() + timeout
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if t_file is None and glob.glob(os.path.join(out, "hang-*.txt")):
                t_file = time.time()
            time.sleep(0.01)
        if proc.poll() is None:
            kill_group(proc)
            res["error"] = f"still running after {timeout:.0f} s"
        reader.join(timeout=5)
        res["exit"] = proc.returncode
        if t_file is None and glob.glob(os.path.join(out, "hang-*.txt")):
            res["error"] = res.get("error") or "hang file found only after the job ended"
        start, entries = hang_start(out)
        res["entries"] = entries
        diag = {}
        for p in sorted(glob.glob(os.path.join(out, "hang-*.json"))):
            with open(p) as f:
                diag = json.load(f).get("diagnosis") or {}
            break
        res["verdict"] = diag.get("verdict")
        res["culprit"] = diag.get("culprit")
        if start is None:
            res["error"] = res.get("error") or "no hang start in the traces"
        if t_line:
            res["latency_line_s"] = t_line[0] - start if start else None
        if t_file is not None:
            res["latency_file_s"] = t_file - start if start else None
        if start is not None and entries:
            firsts = [t for _, t in entries.values()]
            res["entry_spread_s"] = max(firsts) - min(firsts)
        if not t_line and not t_file:
            res["error"] = res.get("error") or "no diagnosis printed"
            res["stderr_tail"] = "".join(tail[-15:])
        return res
    finally:
        shutil.rmtree(out, ignore_errors=True)


def run(sizes: list[int], reps: int, hang_timeout: float = 3.0, log=print) -> tuple[list[Row], dict]:
    raw: dict = {"hang_timeout_s": hang_timeout, "cases": []}
    rows = []
    for n in sizes:
        cases = []
        for rep in range(reps):
            la = loadavg()
            c = run_case(n, hang_timeout)
            c["loadavg"] = la
            cases.append(c)
            raw["cases"].append(c)
            lat = c.get("latency_line_s")
            log(f"  {n:3d} ranks [{rep + 1}/{reps}]: "
                + (f"diagnosis {lat:.2f} s after the last rank entered (file {c.get('latency_file_s', float('nan')):.2f} s), "
                   f"verdict {c.get('verdict')}, culprit {c.get('culprit')}, entry spread "
                   f"{c.get('entry_spread_s', 0):.2f} s" if lat is not None else f"ERROR {c.get('error')}"))
        lats = [c["latency_line_s"] for c in cases if c.get("latency_line_s") is not None]
        files = [c["latency_file_s"] for c in cases if c.get("latency_file_s") is not None]
        right = all(c.get("culprit") == [0] for c in cases)
        limit = hang_timeout + SLACK_S
        value = median(lats) if lats else None
        notes = [f"hang timeout {hang_timeout:g} s", f"reps {len(lats)}/{reps}"]
        if lats:
            notes.append(f"range {min(lats):.2f}-{max(lats):.2f} s")
        if files:
            notes.append(f"hang-N.txt at {median(files):.2f} s")
        notes.append("culprit rank 0 named" if right else "culprit NOT rank 0 in some run")
        errs = [c["error"] for c in cases if c.get("error")]
        if errs:
            notes.append("errors: " + "; ".join(errs[:2]))
        rows.append(Row("3", f"hang detection latency, {n} ranks (torchrun)",
                        f"{value:.2f} s" if value is not None else "n/a", f"<= {limit:g} s",
                        (value <= limit and right) if value is not None else False, ", ".join(notes), value,
                        {"latencies_s": lats, "file_latencies_s": files}))
    return rows, raw
