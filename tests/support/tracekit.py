"""Hand-written trace folders for unit tests of checks: a few records per rank, written as the
recorder would (header, interned sites, records), then loaded and checked in-process."""

from __future__ import annotations

import json
from pathlib import Path

from ddpdoctor.analysis.checks.base import Context
from ddpdoctor.analysis.run import load_run


def write_traces(folder, ranks: dict[int, list[dict]], world: int | None = None, run: str = "unit",
                 hosts: dict[int, str] | None = None) -> Path:
    """One trace file per rank. A record's ``site`` (and a sampler's ``created``) may be given as
    ``(file, line)`` or ``(file, line, source)``: it is interned into a ``site`` record with a
    per-rank id (ids deliberately differ across ranks, as they do in real traces)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    world = world if world is not None else max(ranks) + 1
    for rank, recs in ranks.items():
        sites: dict[tuple, int] = {}
        host = (hosts or {}).get(rank, "h")
        lines = [{"t": "header", "schema": 1, "run": run, "rank": rank, "world": world, "host": host,
                  "pid": 1000 + rank, "attempt": 0, "torch": "2.x", "backend": "gloo", "wall0": 1.0}]
        body = []
        for i, rec in enumerate(recs):
            rec = dict(rec)
            rec.setdefault("ts", 1000 * (i + 1))
            for field in ("site", "created"):
                s = rec.get(field)
                if isinstance(s, (tuple, list)):
                    key = tuple(s)
                    if key not in sites:
                        sid = sites[key] = 7 * rank + 100 + len(sites)
                        lines.append({"t": "site", "id": sid, "file": key[0], "line": key[1], "func": "main",
                                      "src": key[2] if len(key) > 2 else "",
                                      "stack": [[key[0], key[1], "main", key[2] if len(key) > 2 else ""]]})
                    rec[field] = sites[key]
            body.append(rec)
        body.append({"t": "exit", "how": "normal", "ts": 10 ** 9})
        path = folder / f"rank{rank:05d}-h-{1000 + rank}-a0.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in lines + body))
    return folder


def run_check(check_cls, folder) -> list:
    """Findings of one check over a trace folder."""
    return check_cls().run(Context(load_run([str(folder)])))


def coll(g: str, s: int, op: str = "barrier", site=("train.py", 1), **extra) -> dict:
    """A sequence event."""
    return {"t": "c", "op": op, "g": g, "s": s, "d": 1, "site": site, **extra}
