"""Synthetic trace folders for the report's scale benchmark: N ranks x M sequence events each.

Records follow docs/trace-format.md (schema 1) the way ddpdoctor's writer makes them: compact
JSON Lines, a ``header`` first, each ``site`` record just before its first use, ``c`` events in
the writer's field order, ``file`` records with vector clocks, the watchdog's ``pending`` /
``hang`` records (the diagnosis is built by ddpdoctor's own ``hangdiag``) and a ``hang-kill``
``exit`` record. Three bugs are injected at known places, and a correctly ordered file exchange
that must *not* be reported:

- a divergence: at ``divergence.seq`` of group 0, ``divergence.rank`` broadcasts while every
  other rank all-reduces (under an ``if rank == ...:``);
- a file race: rank 0 writes ``race.path`` and rank 1 reads it at the same position, with no
  collective between (missing barrier);
- a hang: after the last event, ``hang.rank`` waits in an all_reduce and the others in a barrier;
  rank 0's watchdog reported it (``hang`` records, ``pending`` records, ``exit`` hang-kill).

    .venv/bin/python -m bench.synth OUT --ranks 64 --events 20000
"""

from __future__ import annotations

import argparse
import json
import os
import time

from ddpdoctor.trace.files import trace_file_name
from ddpdoctor.verdict.hang import diagnose

SRC = "/synth/project/train.py"
HANG_TIMEOUT = 3.0
_PERIOD_BARRIER = 100


def _dumps(rec: dict) -> str:
    return json.dumps(rec, separators=(",", ":"))


def _site(sid: int, line: int, func: str, src: str, cond: str | None = None) -> dict:
    stack = [[SRC, line, func, src], [SRC, 210, "main", "train(args)"], [SRC, 230, "<module>", "main()"]]
    conds = [[SRC, 228, 'if __name__ == "__main__":', "if"]]
    if cond:
        conds.insert(0, [SRC, line - 1, cond, "if"])
    return {"t": "site", "id": sid, "file": SRC, "line": line, "func": func, "src": src,
            "stack": stack, "conds": conds}


def plan(ranks: int, events: int) -> dict:
    """Where the bugs go (what the report must find)."""
    d = events // 2
    while _op_of(d)[0] != "all_reduce" or _op_of(d)[1] != '"float32[1024]"':
        d += 1
    ok_write = _PERIOD_BARRIER * max(1, events // (8 * _PERIOD_BARRIER)) - 1  # a barrier follows
    return {
        "ranks": ranks, "events": events,
        "divergence": {"group": "0", "seq": d, "rank": ranks // 3 if ranks > 2 else 1},
        "race": {"path": "/synth/run/ckpt-race.pt", "writer": 0, "reader": 1, "pos": events // 4},
        "ordered": {"path": "/synth/run/ckpt-ok.pt", "writer": 0, "pos": ok_write},
        "hang": {"group": "0", "seq": events + 1, "rank": ranks - 1},
    }


def _op_of(s: int) -> tuple[str, str, int, int]:
    """(op, tensor description, numel, site) of sequence event s in the training loop."""
    if s % _PERIOD_BARRIER == 0:
        return "barrier", "", 0, 4
    if s % 4 == 3:
        return "all_reduce", '"float32[1]"', 1, 2
    if s % 10 == 5:
        return "broadcast", '"float32[16]"', 16, 3
    return "all_reduce", '"float32[1024]"', 1024, 1


_SITES = {
    0: _site(0, 40, "setup", 'dist.init_process_group("gloo")'),
    1: _site(1, 88, "train", "dist.all_reduce(grads)"),
    2: _site(2, 91, "train", "dist.all_reduce(loss)"),
    3: _site(3, 95, "train", "dist.broadcast(lr, src=0)"),
    4: _site(4, 99, "train", "dist.barrier()"),
    6: _site(6, 120, "save", "torch.save(model.state_dict(), path)", "if rank == 0:"),
    7: _site(7, 126, "resume", "model.load_state_dict(torch.load(path))"),
}


def _events(rank: int, start: int, stop: int, div: dict, t0: int) -> list[str]:
    out = []
    jitter = (rank * 37) % 200
    for s in range(start, stop):
        op, x, n, site = _op_of(s)
        ts = t0 + s * 1000 + jitter
        d = 150 + (s * 7919 + rank * 31) % 700
        if s == div["seq"] and rank == div["rank"]:
            out.append(f'{{"t":"c","op":"broadcast","g":"0","s":{s},"x":["float32[1024]"],"n":1024,'
                       f'"root":0,"ts":{ts},"d":{d},"site":5}}\n')
        elif op == "barrier":
            out.append(f'{{"t":"c","op":"barrier","g":"0","s":{s},"ts":{ts},"d":{d},"site":4}}\n')
        elif op == "broadcast":
            out.append(f'{{"t":"c","op":"broadcast","g":"0","s":{s},"x":[{x}],"n":{n},"root":0,'
                       f'"ts":{ts},"d":{d},"site":3}}\n')
        else:
            out.append(f'{{"t":"c","op":"all_reduce","g":"0","s":{s},"x":[{x}],"n":{n},"rop":"SUM",'
                       f'"ts":{ts},"d":{d},"site":{site}}}\n')
    return out


def _statuses(p: dict, t0: int) -> dict[int, dict]:
    h = p["hang"]
    out = {}
    for r in range(p["ranks"]):
        culprit = r == h["rank"]
        site = _SITES[8] if culprit else _SITES[4]
        frames = [[SRC, 230, "<module>", "main()"], [SRC, 210, "main", "train(args)"],
                  [SRC, site["line"], site["func"], site["src"]]]
        out[r] = {"rank": r, "pid": 10000 + r, "host": f"node{r // 8}", "seq": {"0": h["seq"]},
                  "cpu": 0.0, "ddp_steps": 0, "state": "collective",
                  "op": "all_reduce" if culprit else "barrier", "g": "0", "s": h["seq"], "site": site,
                  "since_s": round(HANG_TIMEOUT + 0.1 - (r % 7) * 0.01, 3),
                  "stacks": [{"thread": "MainThread", "main": True, "frames": frames}]}
    return out


def _slim(status: dict) -> dict:
    s = dict(status)
    s["stacks"] = [dict(t, frames=t["frames"][-12:]) for t in s["stacks"] if t.get("main")]
    return s


def write(out: str, ranks: int, events: int, run_id: str = "synth0000001") -> dict:
    """Write the folder; returns the plan plus ``bytes`` and ``seconds`` (generation)."""
    t_start = time.perf_counter()
    os.makedirs(out, exist_ok=True)
    p = plan(ranks, events)
    div, race, ok, hang = p["divergence"], p["race"], p["ordered"], p["hang"]
    _SITES[5] = _site(5, 93, "train", "dist.broadcast(grads, src=0)", f"if rank == {div['rank']}:")
    _SITES[8] = _site(8, 140, "train", "dist.all_reduce(stats)", f"if rank == {hang['rank']}:")
    t0 = 200_000
    statuses = _statuses(p, t0)
    hang_ts = t0 + (events + 1) * 1000
    diag = diagnose(statuses, ranks, HANG_TIMEOUT, 0)
    wall0 = time.time()
    total = 0
    chunk = 4096
    for r in range(ranks):
        host = f"node{r // 8}"
        path = os.path.join(out, trace_file_name(r, host, 10000 + r, 0))
        head = [
            {"t": "header", "schema": 1, "run": run_id, "rank": r, "local_rank": r % 8, "world": ranks,
             "host": host, "pid": 10000 + r, "attempt": 0, "torch": "2.13.0+cpu", "backend": "gloo",
             "argv": ["train.py"], "python": "3.11.7", "wall0": wall0 + r * 1e-3, "pg_timeout_s": 1800.0,
             "hang_timeout_s": HANG_TIMEOUT, "tool": "ddpdoctor"},
            _SITES[0],
            {"t": "init", "g": "0", "rank": r, "world": ranks, "backend": "gloo", "ts": t0 - 5000, "site": 0},
        ]
        # (sequence position after which a record goes, record) for the rare records
        extra: list[tuple[int, dict]] = []
        if r == ok["writer"]:
            extra.append((ok["pos"], {"t": "file", "op": "w", "path": ok["path"], "pos": {"0": ok["pos"]},
                                      "ts": t0 + ok["pos"] * 1000 + 500, "site": 6}))
        elif r <= 3:  # a few ranks read it after the barrier that follows the write
            extra.append((ok["pos"] + 1, {"t": "file", "op": "r", "path": ok["path"],
                                          "pos": {"0": ok["pos"] + 1},
                                          "ts": t0 + (ok["pos"] + 1) * 1000 + 600, "site": 7}))
        if r == race["writer"]:
            extra.append((race["pos"], {"t": "file", "op": "w", "path": race["path"],
                                        "pos": {"0": race["pos"]}, "ts": t0 + race["pos"] * 1000 + 500,
                                        "site": 6}))
        elif r == race["reader"]:
            extra.append((race["pos"], {"t": "file", "op": "r", "path": race["path"],
                                        "pos": {"0": race["pos"]}, "ts": t0 + race["pos"] * 1000 + 700,
                                        "site": 7}))
        extra.sort(key=lambda e: e[0])
        with open(path, "w", encoding="utf-8") as f:
            # sites 1-4 are all used within the first 100 events: written before them
            f.write("".join(_dumps(x) + "\n" for x in head + [_SITES[i] for i in (1, 2, 3, 4)]))
            seen_sites = {0, 1, 2, 3, 4}
            marks = {e[0] for e in extra}
            if r == div["rank"]:
                marks.add(div["seq"] - 1)
            s = 1
            for stop in sorted(marks) + [events]:
                for a in range(s, stop + 1, chunk):
                    f.write("".join(_events(r, a, min(stop + 1, a + chunk), div, t0)))
                s = stop + 1
                if r == div["rank"] and stop == div["seq"] - 1:
                    seen_sites.add(5)
                    f.write(_dumps(_SITES[5]) + "\n")
                for pos, rec in extra:
                    if pos == stop:
                        if rec["site"] not in seen_sites:
                            seen_sites.add(rec["site"])
                            f.write(_dumps(_SITES[rec["site"]]) + "\n")
                        f.write(_dumps(rec) + "\n")
            st = statuses[r]
            site_id = st["site"]["id"]
            tail = []
            if site_id not in seen_sites:
                tail.append(_SITES[site_id])
            start = hang_ts + (r * 13) % 400
            tail.append({"t": "pending", "op": st["op"], "g": "0", "s": hang["seq"], "site": site_id,
                         "ts": start, "waited_s": 1.2})
            now = hang_ts + int(HANG_TIMEOUT * 1e6) + 200_000
            if r == 0:
                tail.append({"t": "hang", "role": "reporter", "ep": 1, "status": st, "diag": diag, "ts": now,
                             "statuses": {str(k): _slim(v) for k, v in statuses.items()}})
            else:
                tail.append({"t": "hang", "role": "member", "ep": 1, "status": st, "ts": now + 50_000})
            tail.append({"t": "exit", "how": "hang-kill", "ts": now + 300_000,
                         "inflight": [[st["op"], "0", hang["seq"], site_id, start]]})
            f.write("".join(_dumps(x) + "\n" for x in tail))
            total += f.tell()
    p["bytes"] = total
    p["seconds"] = time.perf_counter() - t_start
    p["files"] = ranks
    return p


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--events", type=int, default=20000)
    a = ap.parse_args()
    p = write(a.out, a.ranks, a.events)
    print(json.dumps(p, indent=1))


if __name__ == "__main__":
    main()
