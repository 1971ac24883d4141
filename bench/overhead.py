"""Figures 1, 2 and 5: what recording costs a real 2-rank gloo job, and what it writes.

Every repetition launches the same job (``bench/rankprog.py`` under torchrun, 2 ranks on
loopback) three ways, interleaved: plain, under ddpdoctor (the real injection:
``ddpdoctor.launcher.child_env`` + the PYTHONPATH bootstrap, hang watchdog on at its default
timeout, file recording on), and with ``TORCH_DISTRIBUTED_DEBUG=DETAIL``. Times are taken inside
the ranks around each loop; a figure is the median over repetitions of the per-call time, divided
by the plain run's median from the same invocation.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import tempfile
import time

from .common import BENCH, Row, loadavg, median, plain_env, run_bounded, spread, torchrun

MODES = ("plain", "ddpdoctor", "detail")
COLLECTIVES = ("allreduce_1", "allreduce_1m", "barrier", "broadcast", "all_gather_object")
LABELS = {
    "allreduce_1": "all_reduce, 1 element",
    "allreduce_1m": "all_reduce, 1M elements (4 MB)",
    "barrier": "barrier",
    "broadcast": "broadcast, 1 element",
    "all_gather_object": "all_gather_object (a small dict)",
    "train": "DDP training loop (3 Linear, SGD, sampler, ckpt/epoch)",
}
TARGETS = {"allreduce_1": 1.05, "allreduce_1m": 1.01, "train": 1.02}
TRACE_BYTES_TARGET = 300
#: DETAIL runs this fraction of the calls (it is several times slower; the figure is per call).
DETAIL_SCALE = {False: 0.1, True: 0.25}  # full, --quick


def _env(mode: str, trace_dir: str) -> dict[str, str]:
    env = plain_env()
    env["PYTHONFAULTHANDLER"] = "1"  # a crash names its Python line (all modes alike)
    if mode == "ddpdoctor":
        from ddpdoctor import launcher
        from ddpdoctor.rank import settings

        env = launcher.child_env(trace_dir, settings.DEFAULT_HANG_TIMEOUT, "report", base=env)
    elif mode == "detail":
        env["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    return env


def _crash(rc: int | None, err: str) -> str:
    """One line on how a job died: the signal and the Python line it died in."""
    if rc is None:
        return "timed out"
    sig = re.search(r"Signal (\d+) \((SIG\w+)\)", err)
    what = sig.group(2) if sig else f"exit status {rc}"
    fatal = re.search(r"Fatal Python error: ([^\n]+)", err)
    frame = re.compile(r'File "([^"]+)", line (\d+) in (\S+)').search(err, fatal.end()) if fatal else None
    if fatal:
        what += f" ({fatal.group(1).strip()})"
        if frame:
            what += f" in {frame.group(3)} at {frame.group(1).split('site-packages/')[-1]}:{frame.group(2)}"
    else:
        last = [ln for ln in err.splitlines() if ln.strip(" =-") and not ln.startswith(("W1", "I1", "E1"))
                and "torch/distributed/elastic" not in ln and not ln.strip().startswith(("[", "time", "host",
                                                                                        "rank", "exitcode",
                                                                                        "error_file", "traceback"))]
        if last:
            what += f": {last[-1].strip()[:160]}"
    return what


def _trace_size(results: list[dict]) -> dict | None:
    """Bytes and records each rank wrote during the timed training loop."""
    total_bytes = records = seq_events = 0
    for r in results:
        t = r.get("train") or {}
        path = t.get("trace_file")
        if not path or not os.path.exists(path):
            return None
        with open(path, "rb") as f:
            f.seek(t["trace_from"])
            chunk = f.read(t["trace_to"] - t["trace_from"])
        total_bytes += len(chunk)
        lines = chunk.splitlines()
        records += len(lines)
        seq_events += sum(1 for ln in lines if ln.startswith(b'{"t":"c"'))
    steps = sum((r.get("train") or {}).get("calls", 0) for r in results)
    return {"bytes": total_bytes, "records": records, "seq_events": seq_events, "steps": steps}


def launch(mode: str, workloads: list[str], quick: bool, timeout: float) -> dict:
    """One job; returns per-workload {seconds, calls} (max over ranks) or {error}."""
    res_dir = tempfile.mkdtemp(prefix="ddpdoctor-bench-res-")
    trace_dir = tempfile.mkdtemp(prefix="ddpdoctor-bench-trace-")
    try:
        args = ["--workloads", ",".join(workloads), "--result-dir", res_dir, "--pg-timeout", "120"]
        if quick:
            args.append("--quick")
        if mode == "detail":
            args += ["--scale", str(DETAIL_SCALE[quick])]
        if mode == "ddpdoctor":
            args.append("--ab")
        t0 = time.monotonic()
        rc, _out, err = run_bounded(torchrun(2, BENCH / "rankprog.py", *args), _env(mode, trace_dir), timeout)
        wall = time.monotonic() - t0
        per_rank = []
        for p in sorted(glob.glob(os.path.join(res_dir, "rank*.json"))):
            with open(p) as f:
                per_rank.append(json.load(f))
        out: dict = {"_wall": wall, "_rc": rc}
        for w in workloads:
            rs = [r.get(w) for r in per_rank]
            if len(rs) == 2 and all(r and "seconds" in r for r in rs):
                out[w] = {"seconds": max(r["seconds"] for r in rs), "calls": rs[0]["calls"],
                          "cpu_main": sum(r.get("cpu_main", 0) for r in rs) / 2}
                if all("ab" in r for r in rs):  # per block: the slower rank's time, mean CPU
                    a = [r["ab"] for r in rs]
                    out[w]["ab"] = {k: [max(x) if k.endswith("_s") else sum(x) / 2 for x in zip(*(b[k] for b in a))]
                                    for k in ("on_s", "off_s", "on_cpu", "off_cpu")}
            elif any(r and "error" in r for r in rs):
                out[w] = {"error": next(r["error"] for r in rs if r and "error" in r)}
            else:
                out[w] = {"error": "crashed: " + _crash(rc, err)}
        if mode == "ddpdoctor" and "train" in workloads and len(per_rank) == 2:
            out["_trace"] = _trace_size(per_rank)
            out["_trace_files"] = len(glob.glob(os.path.join(trace_dir, "rank*.jsonl")))
        return out
    finally:
        shutil.rmtree(res_dir, ignore_errors=True)
        shutil.rmtree(trace_dir, ignore_errors=True)


def run(workloads: list[str], quick: bool, reps: int, modes: tuple[str, ...] = MODES,
        log=print) -> tuple[list[Row], dict]:
    timeout = 300 if quick else 900
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    loads = []
    for rep in range(reps):
        for mode in modes:
            loads.append(loadavg())
            r = launch(mode, workloads, quick, timeout)
            runs[mode].append(r)
            summary = ", ".join(f"{w} {r[w]['seconds']:.2f}s" if "seconds" in r[w] else f"{w} ERROR"
                                for w in workloads)
            log(f"  [{rep + 1}/{reps}] {mode:9s} {r['_wall']:5.0f}s wall: {summary}")
    loads.append(loadavg())
    rows = _rows(workloads, runs, modes)
    raw = {"runs": runs, "loadavg": loads, "reps": reps, "detail_scale": DETAIL_SCALE[quick]}
    for row in rows:
        row.data["loadavg_max"] = max(loads)
    return rows, raw


def _per_call(runs: list[dict], w: str, key: str = "seconds") -> tuple[list[float], str | None]:
    vals, err = [], None
    for r in runs:
        x = r.get(w) or {}
        if key in x and x.get("calls"):
            vals.append(x[key] / x["calls"])
        else:
            err = err or x.get("error", "no result")
    return vals, err


def _rows(workloads: list[str], runs: dict[str, list[dict]], modes) -> list[Row]:
    rows: list[Row] = []
    for w in workloads:
        plain, perr = _per_call(runs.get("plain", []), w)
        dd, derr = _per_call(runs.get("ddpdoctor", []), w)
        det, deterr = _per_call(runs.get("detail", []), w)
        fig = "2" if w == "train" else "1"
        unit = "step" if w == "train" else "call"
        target = TARGETS.get(w)
        notes = []
        data = {"plain_s_per_call": plain, "ddpdoctor_s_per_call": dd, "detail_s_per_call": det}
        value = None
        if plain and dd:
            value = median(dd) / median(plain)
            notes.append(f"plain {median(plain) * 1e6:.0f} µs/{unit}, ddpdoctor "
                         f"{(median(dd) - median(plain)) * 1e6:+.1f} µs/{unit}")
            cp, cd = _per_call(runs["plain"], w, "cpu_main")[0], _per_call(runs["ddpdoctor"], w, "cpu_main")[0]
            if cp and cd:
                notes.append(f"main-thread CPU {(median(cd) - median(cp)) * 1e6:+.1f} µs/{unit}")
                data["cpu_main_plain"], data["cpu_main_ddpdoctor"] = cp, cd
            notes.append(f"plain reps spread {spread(plain) * 100:.1f}%")
        on = [v for r in runs.get("ddpdoctor", []) for v in (r.get(w) or {}).get("ab", {}).get("on_s", [])]
        off = [v for r in runs.get("ddpdoctor", []) for v in (r.get(w) or {}).get("ab", {}).get("off_s", [])]
        if on and off:
            data["ab_ratio"] = median(on) / median(off)
            data["ab"] = [(r.get(w) or {}).get("ab") for r in runs.get("ddpdoctor", [])]
            notes.append(f"in-process A/B (recording on/off, {len(on)}+{len(off)} blocks) "
                         f"{median(on) / median(off):.3f}x")
        if "detail" in modes:
            if det and plain:
                notes.append(f"DETAIL {median(det) / median(plain):.2f}x")
                data["detail_ratio"] = median(det) / median(plain)
            else:
                notes.append(f"DETAIL failed: {deterr}")
                data["detail_error"] = deterr
        if perr or derr:
            notes.append(f"error: {perr or derr}")
        calls = next((r[w]["calls"] for r in runs.get("plain", []) if "calls" in r.get(w, {})), None)
        what = f"{LABELS[w]} x{calls}" if calls else LABELS[w]
        rows.append(Row(fig, what, f"{value:.3f}x" if value is not None else "n/a",
                        f"<= {target}x" if target else "", (value <= target) if (target and value) else None,
                        "; ".join(notes), value, data))
    if "train" in workloads:
        sizes = [r["_trace"] for r in runs.get("ddpdoctor", []) if r.get("_trace")]
        if sizes:
            s = sizes[-1]
            per_rec = s["bytes"] / max(1, s["records"])
            rows.append(Row("5", "trace bytes per record, training loop", f"{per_rec:.0f} B",
                            f"<= {TRACE_BYTES_TARGET} B", per_rec <= TRACE_BYTES_TARGET,
                            f"{s['records']} records ({s['seq_events']} sequence events) for "
                            f"{s['steps']} rank-steps on 2 ranks: {s['bytes'] / max(1, s['steps']):.0f} "
                            f"B/step/rank, {s['bytes'] / max(1, s['seq_events']):.0f} B per sequence event",
                            per_rec, dict(s)))
        else:
            rows.append(Row("5", "trace bytes per record, training loop", "n/a", f"<= {TRACE_BYTES_TARGET} B",
                            None, "no traced training run completed"))
    return rows
