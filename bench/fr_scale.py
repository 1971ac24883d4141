"""Figure 7: reading Flight Recorder dumps at scale (``ddpdoctor report`` on FR dumps).

Synthetic dumps shaped like torch 2.13's (``_dump_fr_trace()``: protocol-2 pickles whose equal
frame dicts are shared through the memo, one new ``frames`` list per entry, 9-frame stacks
through torch, the user's training loop and the launcher) for N ranks x 2,000 entries: a ring
buffer that wrapped long ago (sequence ids from 100,001), DDP-like bucket all-reduces,
parameter broadcasts, metric all-gathers and barriers, and one injected bug: one rank's last call
is a barrier where every other rank waits in an all-reduce. The report runs in a child process
(``bench.scale.report``: wall time, CPU time, peak RSS of the largest process and of the tree);
it must name that rank at that sequence id. Memory must stay flat in the number of ranks.
"""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
import time

from ddpdoctor.analysis import frnative

from .common import Row, loadavg
from .scale import report

TIME_TARGET_S = 10.0  # 1024 ranks x 2000 entries, read and analysed
MEMORY_TOLERANCE = 1.25  # peak RSS at 1024 ranks vs 128 ranks
ENTRIES = 2000
FIRST_SEQ = 100_001
_TORCH = "/opt/venv/lib/python3.11/site-packages/torch/"
_PY = "/usr/lib/python3.11/"


def _frame(filename: str, line: int, name: str) -> dict:
    return {"filename": filename, "line": line, "name": name}


def _stacks() -> dict[str, list[dict]]:
    """Shared frame dicts per call kind (torch's pickler memoizes equal dicts the same way)."""
    outer = [_frame("/home/user/train.py", 140, "main"), _frame("/home/user/train.py", 171, "<module>"),
             _frame(_TORCH + "distributed/elastic/multiprocessing/errors/__init__.py", 357, "wrapper"),
             _frame(_PY + "runpy.py", 88, "_run_code")]
    c10d = _TORCH + "distributed/distributed_c10d.py"
    log = _frame(_TORCH + "distributed/c10d_logger.py", 83, "wrapper")
    return {
        "bucket": [_frame(_TORCH + "autograd/graph.py", 829, "_engine_run_backward"),
                   _frame(_TORCH + "_tensor.py", 623, "backward"),
                   _frame("/home/user/train.py", 97, "train_step"),
                   _frame("/home/user/train.py", 121, "train_epoch")] + outer,
        "broadcast": [_frame(c10d, 2840, "broadcast"), log,
                      _frame(_TORCH + "nn/parallel/distributed.py", 1652, "_sync_buffers"),
                      _frame("/home/user/train.py", 95, "train_step")] + outer,
        "gather": [_frame(c10d, 4280, "all_gather"), log, _frame("/home/user/metrics.py", 33, "gather_loss"),
                   _frame("/home/user/train.py", 125, "train_epoch")] + outer,
        "barrier": [_frame(c10d, 5356, "barrier"), log, _frame("/home/user/train.py", 131, "train_epoch")] + outer,
        "bad_barrier": [_frame(c10d, 5356, "barrier"), log, _frame("/home/user/checkpoint.py", 58, "save"),
                        _frame("/home/user/train.py", 128, "train_epoch")] + outer,
    }


def _entry(rank: int, i: int, seq: int, kind: str, stacks: dict, world: int, last: bool) -> dict:
    op, sizes, out = {"bucket": ("all_reduce", [[1048576]], [[1048576]]),
                      "broadcast": ("broadcast", [[512]], [[512]]),
                      "gather": ("all_gather", [[1]], [[world, 1]]),
                      "barrier": ("barrier", [], []),
                      "bad_barrier": ("barrier", [], [])}[kind]
    created = 1_796_000_000_000_000_000 + seq * 2_000_000 + rank * 1000
    return {"record_id": 50_000 + i, "pg_id": 0, "process_group": ("0", "default_pg"),
            "collective_seq_id": seq, "p2p_seq_id": 0, "op_id": seq, "profiling_name": f"nccl:{op}",
            "time_created_ns": created, "duration_ms": None if last else 1.5,
            "input_sizes": sizes, "input_dtypes": ["Float"] * len(sizes),
            "output_sizes": out, "output_dtypes": ["Float"] * len(out),
            "state": "started" if last else "completed", "time_discovered_started_ns": created + 1000,
            "time_discovered_completed_ns": None if last else created + 1_500_000,
            "retired": not last, "timeout_ms": 600_000, "is_p2p": False, "thread_id": "1",
            "thread_name": "python", "frames": list(stacks[kind])}


def write(folder: str, ranks: int, entries: int = ENTRIES) -> dict:
    """``ranks`` dumps named like the NCCL watchdog's (``nccl_trace_rank_<r>``); returns the bug."""
    t0 = time.perf_counter()
    stacks = _stacks()
    bad = ranks // 2 + 5 if ranks > 8 else 1
    kinds = ["broadcast", "bucket", "bucket", "bucket", "gather"]
    total = 0
    for r in range(ranks):
        es = []
        for i in range(entries):
            seq = FIRST_SEQ + i
            last = i == entries - 1
            kind = kinds[i % len(kinds)] if i % 97 else "barrier"
            if last:
                kind = "bad_barrier" if r == bad else "bucket"
            es.append(_entry(r, i, seq, kind, stacks, ranks, last))
        dump = {"version": "2.10", "comm_lib_version": "2.27.5",
                "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": str(list(range(ranks)))}},
                "pg_status": {"0": {"last_enqueued_collective": FIRST_SEQ + entries - 1,
                                    "last_started_collective": FIRST_SEQ + entries - 1,
                                    "last_completed_collective": FIRST_SEQ + entries - 2}},
                "entries": es}
        data = pickle.dumps(dump, protocol=2)
        total += len(data)
        with open(os.path.join(folder, f"nccl_trace_rank_{r}"), "wb") as f:
            f.write(data)
    return {"bad": bad, "seq": FIRST_SEQ + entries - 1, "bytes": total, "seconds": time.perf_counter() - t0}


def measure(ranks: int, base: str, log=print) -> dict:
    folder = tempfile.mkdtemp(prefix=f"fr-{ranks}x{ENTRIES}-", dir=base)
    try:
        bug = write(folder, ranks)
        la = loadavg()
        r = report(folder)
        doc = r.pop("doc")
        fs = doc.get("findings") or []
        ok = any(f["id"] == "DD001" and f["ranks"] == [bug["bad"]] and f["data"].get("seq") == bug["seq"]
                 for f in fs)
        res = {"ranks": ranks, "entries_per_rank": ENTRIES, "bytes": bug["bytes"], "gen_s": bug["seconds"],
               "loadavg": la, **r, "entries_per_s": ranks * ENTRIES / r["wall_s"], "found": ok,
               "finding_ids": sorted({f["id"] for f in fs}),
               "c_reader": frnative.available()}  # the report (a child) inherits the environment
        log(f"  {ranks:5d} ranks x {ENTRIES} entries ({bug['bytes'] / 2**20:.0f} MB of dumps): report "
            f"{r['wall_s']:.2f} s wall, {r['cpu_s']:.2f} s CPU, {res['entries_per_s']:.0f} entries/s, peak RSS "
            f"{r['maxrss_mb']:.0f} MB (tree {r['tree_peak_mb']:.0f} MB); culprit rank {bug['bad']} at "
            f"#{bug['seq']}: {'found' if ok else 'NOT FOUND'}; C pickle reader {'on' if res['c_reader'] else 'off'}")
        return res
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def run(quick: bool, log=print, base: str | None = None) -> tuple[list[Row], dict]:
    base = base or tempfile.gettempdir()
    small_n, big_n = (32, 256) if quick else (128, 1024)
    small = measure(small_n, base, log)
    big = measure(big_n, base, log)
    mem = big["maxrss_mb"] / small["maxrss_mb"]
    rows = [
        Row("7", f"FR dumps: report on {big_n} ranks x {ENTRIES} entries", f"{big['wall_s']:.1f} s",
            f"<= {TIME_TARGET_S:.0f} s" if not quick else "", big["wall_s"] <= TIME_TARGET_S if not quick else None,
            f"{big['cpu_s']:.1f} s CPU, {big['entries_per_s'] / 1000:.0f}k entries/s, peak RSS "
            f"{big['maxrss_mb']:.0f} MB (tree {big['tree_peak_mb']:.0f} MB), {big['bytes'] / 2**20:.0f} MB of dumps; "
            f"culprit {'found' if big['found'] else 'MISSED'}", big["wall_s"], big),
        Row("7", f"FR dumps: peak memory, {big_n} vs {small_n} ranks", f"{mem:.2f}x", f"<= {MEMORY_TOLERANCE}x",
            mem <= MEMORY_TOLERANCE, f"{small['maxrss_mb']:.0f} MB -> {big['maxrss_mb']:.0f} MB (tree "
            f"{small['tree_peak_mb']:.0f} -> {big['tree_peak_mb']:.0f} MB)", mem),
        Row("7", "FR dumps: injected culprit found", "found" if small["found"] and big["found"] else "MISSED",
            "found", small["found"] and big["found"], "", None),
    ]
    return rows, {"results": [small, big]}


if __name__ == "__main__":
    import sys

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 128
    measure(n, tempfile.gettempdir())
