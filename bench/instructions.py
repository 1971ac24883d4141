"""Figure 8: what recording costs, counted in instructions and syscalls instead of wall time.

Wall clock on a shared 2-core machine moves 10-30% between identical runs, more than the cost
being measured. ``valgrind --tool=callgrind`` counts user-space instructions (all threads), which
hardly depend on the machine's load; ``strace -f`` counts the syscalls, which callgrind leaves
out. Method (bench/instrprog.py): per call = (count of a loop of N2 calls - count of a loop of
N1 calls) / (N2 - N1), both loops in the same process after a warm-up, cut apart by marker
calls. Each configuration runs plain and under ddpdoctor (the real injection,
``launcher.child_env``: the bootstrap and file recording; the hang watchdog off, see WATCHDOG),
with ``OMP_NUM_THREADS=1``.

- One-element collectives and the DDP step run with world size 1 (one gloo rank: no network
  wait in the count).
- ``isend``/``irecv`` and the FSDP2 step need world size 2: gloo cannot send to its own rank,
  and ``fully_shard`` issues no collective on a world of one. Only rank 0 runs under the
  counting tool; rank 1 is a plain process (traced too in the traced configuration), and rank
  0's count covers its own work, not the time it waits for rank 1 (gloo waits block).

Skipped, with a message, where valgrind (or strace) is not installed.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from .common import BENCH, PY, Row, free_port, kill_group, plain_env
from .instrprog import OPS_WS1, OPS_WS2

LABELS = {
    "all_reduce": "all_reduce, 1 element", "broadcast": "broadcast, 1 element", "barrier": "barrier",
    "all_gather_into_tensor": "all_gather_into_tensor, 1 element",
    "reduce_scatter_tensor": "reduce_scatter_tensor, 1 element per rank",
    "isend_irecv": "isend + irecv + 2 wait (2 ranks)",
    "ddp": "DDP step: Linear(64,256)-ReLU-Linear(256,10), batch 32, SGD",
    "fsdp2": "FSDP2 step: same model, fully_shard on both Linear + root (2 ranks)",
}
TARGETS = {"all_reduce": 1.15, "broadcast": 1.15, "barrier": 1.15, "all_gather_into_tensor": 1.15,
           "reduce_scatter_tensor": 1.15, "ddp": 1.02, "fsdp2": 1.03}
#: (N1, N2) for one collective; steps run a tenth of these (instrprog.STEP_OPS).
COUNTS = {False: (400, 1600), True: (150, 450)}


def available() -> str | None:
    """None, or why this figure cannot be measured here."""
    if shutil.which("valgrind") is None:
        return "valgrind not installed (Debian/Ubuntu: apt-get install valgrind): instruction counts skipped"
    return None


#: The hang watchdog wakes up twice a second whatever the program does, so its cost is per
#: second of wall time, not per call. Under callgrind a call takes ~50x longer than it does
#: natively, so counted per call the watchdog looks ~50x more expensive than it is, by an amount
#: that moves with the machine's load (the DDP step: +20k to +60k instructions). The per-call
#: counts are therefore taken with the watchdog off (``--hang-timeout 0``) unless
#: ``watchdog=True`` (``python -m bench --instr-watchdog``).
WATCHDOG = False


def _env(traced: bool, trace_dir: str, watchdog: bool = WATCHDOG) -> dict[str, str]:
    env = plain_env()
    env["OMP_NUM_THREADS"] = "1"
    if traced:
        from ddpdoctor import launcher
        from ddpdoctor.rank import settings

        env = launcher.child_env(trace_dir, settings.DEFAULT_HANG_TIMEOUT if watchdog else 0.0, "report",
                                 base=env)
    return env


def _run_config(tool: str, world: int, ops: tuple[str, ...], traced: bool, quick: bool,
                timeout: float, watchdog: bool = WATCHDOG) -> dict:
    """One process group (1 or 2 ranks), rank 0 under ``tool``; returns {op: per-call count}."""
    work = tempfile.mkdtemp(prefix=f"ddpdoctor-bench-{tool}-")
    try:
        env = _env(traced, os.path.join(work, "traces"), watchdog)
        n1, n2 = COUNTS[quick]
        port = free_port()
        args = ["--world", str(world), "--port", str(port), "--ops", ",".join(ops), "--n1", str(n1),
                "--n2", str(n2)]
        prog = str(BENCH / "instrprog.py")
        labels_path = os.path.join(work, "labels.json")
        if tool == "callgrind":
            wrap = ["valgrind", "--tool=callgrind", "--dump-before=getppid", "--dump-line=no",
                    f"--callgrind-out-file={work}/cg.%p"]
        else:
            wrap = ["strace", "-f", "-qq", "-o", f"{work}/strace.txt"]
        procs = [subprocess.Popen(wrap + [PY, prog, "--rank", "0", "--labels", labels_path] + args,
                                  env=env, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, start_new_session=True)]
        if world == 2:
            procs.append(subprocess.Popen([PY, prog, "--rank", "1"] + args, env=env, cwd=work,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                          start_new_session=True))
        deadline = time.monotonic() + timeout
        errs = []
        for p in procs:
            try:
                _, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for q in procs:
                    kill_group(q)
                return {"error": f"{tool} run timed out after {timeout:.0f} s"}
            if p.returncode != 0:
                errs.append(f"exit {p.returncode}: {err.strip().splitlines()[-1:] if err else ''}")
        if errs or not os.path.exists(labels_path):
            return {"error": "; ".join(errs) or "no labels written"}
        with open(labels_path) as f:
            labels = json.load(f)
        parts = _callgrind_parts(work) if tool == "callgrind" else _strace_parts(f"{work}/strace.txt")
        if len(parts) < len(labels):
            return {"error": f"{len(parts)} counted parts for {len(labels)} markers"}
        counts = dict(zip(labels, parts))
        out: dict = {}
        for op in ops:
            (k1, c1), (k2, c2) = [(int(lb.split(":")[1]), counts[lb]) for lb in labels
                                  if lb.startswith(op + ":") and not lb.endswith(":warmup")]
            out[op] = {"per_call": (c2 - c1) / (k2 - k1), "n1": k1, "n2": k2, "count_n1": c1, "count_n2": c2}
        return out
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _callgrind_parts(work: str) -> list[int]:
    """Instruction totals of the dumps ``name.1``, ``name.2``..., one per marker, in order."""
    files = glob.glob(os.path.join(work, "cg.*.*"))
    files.sort(key=lambda p: int(p.rsplit(".", 1)[1]))
    out = []
    for p in files:
        with open(p) as f:
            total = next((int(line.split()[1]) for line in f if line.startswith("totals:")), 0)
        out.append(total)
    return out


_SYSCALL = re.compile(r"^\d+\s+(?:<\.\.\. )?(\w+)")


def _strace_parts(path: str) -> list[int]:
    """Syscalls between consecutive ``getppid`` markers (all threads); a call split by strace
    into "unfinished" and "resumed" lines counts once."""
    out, n = [], 0
    with open(path, errors="replace") as f:
        for line in f:
            if " resumed>" in line:
                continue
            m = _SYSCALL.match(line)
            if not m:
                continue
            n += 1
            if m.group(1) == "getppid":
                out.append(n)
                n = 0
    return out


def run(quick: bool, log=print, watchdog: bool = WATCHDOG) -> tuple[list[Row], dict]:
    why = available()
    if why:
        log(f"  skipped: {why}")
        return [Row("8", "instruction counts", "skipped", "", None, why)], {"skipped": why}
    tools = ["callgrind"] + (["strace"] if shutil.which("strace") else [])
    if "strace" not in tools:
        log("  strace not installed: syscalls per call skipped")
    timeout = 900 if quick else 1800
    jobs = [(tool, world, ops, traced) for tool in tools for world, ops in ((1, OPS_WS1), (2, OPS_WS2))
            for traced in (False, True)]
    results: dict = {}
    # Two at a time: each callgrind run is one busy core for a few minutes.
    with ThreadPoolExecutor(max_workers=2) as pool:
        futs = {job: pool.submit(_run_config, *job, quick, timeout, watchdog) for job in jobs}
        for (tool, world, ops, traced), fut in futs.items():
            r = fut.result()
            results.setdefault(tool, {}).setdefault("traced" if traced else "plain", {}).update(
                r if "error" not in r else {op: {"error": r["error"]} for op in ops})
            log(f"  {tool:9s} world {world} {'traced' if traced else 'plain ':6s}: "
                + (r["error"] if "error" in r else ", ".join(f"{op} {v['per_call']:,.0f}" for op, v in r.items())))
    results["watchdog"] = watchdog
    return _rows(results, watchdog), results


def _fmt(n: float) -> str:
    return f"{n / 1e6:.3f}M" if abs(n) >= 1e6 else f"{n / 1e3:.1f}k"


def _rows(results: dict, watchdog: bool = WATCHDOG) -> list[Row]:
    rows = []
    cg, st = results.get("callgrind", {}), results.get("strace", {})
    for op in OPS_WS1 + OPS_WS2:
        p, t = cg.get("plain", {}).get(op, {}), cg.get("traced", {}).get(op, {})
        sp, stt = st.get("plain", {}).get(op, {}), st.get("traced", {}).get(op, {})
        target = TARGETS.get(op)
        unit = "step" if op in ("ddp", "fsdp2") else "call"
        notes = []
        if not watchdog:
            notes.append("hang watchdog off (a per-second cost, see bench/instructions.py)")
        if "per_call" in sp and "per_call" in stt:
            notes.append(f"syscalls/{unit} {sp['per_call']:.1f} plain, {stt['per_call']:.1f} traced")
        if "per_call" in p and "per_call" in t:
            ratio = t["per_call"] / p["per_call"]
            notes.insert(0, f"{_fmt(p['per_call'])} plain, {_fmt(t['per_call'])} traced "
                            f"({t['per_call'] - p['per_call']:+,.0f} instructions/{unit})")
            rows.append(Row("8", f"instructions: {LABELS[op]}", f"{ratio:.3f}x",
                            f"<= {target}x" if target else "", ratio <= target if target else None,
                            "; ".join(notes), ratio, {"plain": p, "traced": t, "strace_plain": sp,
                                                      "strace_traced": stt}))
        else:
            err = p.get("error") or t.get("error") or "not measured"
            rows.append(Row("8", f"instructions: {LABELS[op]}", "n/a", f"<= {target}x" if target else "",
                            None, f"error: {err}"))
    return rows
