"""Hand-written trace folders where the test controls how each rank ended (exit record, none at
all, a stack dump) and the branch headers around call sites; plus a runner for several checks
sharing one context, as ``ddpdoctor report`` runs them."""

from __future__ import annotations

import json
from pathlib import Path

from ddpdoctor.analysis.checks import all_checks
from ddpdoctor.analysis.checks.base import Context
from ddpdoctor.analysis.run import load_run

NORMAL = {"t": "exit", "how": "normal"}
GLOO_CLOSED = ("RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
               "closed by peer [127.0.0.1]:4242. This is typically caused by a remote worker crashing.")
GLOO_TIMEOUT = ("RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] "
                "Timed out waiting 5000ms for recv operation to complete")
NO_PG = ("ValueError: Default process group has not been initialized, please make sure to call "
         "init_process_group.")


def raised(exc: str, line: int = 17, file: str = "train.py", inflight=(), func: str = "main") -> dict:
    """An exit record for an uncaught exception."""
    return {"t": "exit", "how": "exception", "exc": exc, "file": file, "line": line, "func": func,
            "stack": [[file, line, func, "x = load()"]], "inflight": [list(i) for i in inflight]}


def write_run(folder, ranks: dict[int, list[dict]], exits: dict | None = None, world: int | None = None,
              run: str = "unit", dumps: tuple = (), wall0: float = 1.0) -> Path:
    """One trace file per rank. A record's ``site`` may be ``(file, line)``, ``(file, line,
    source)`` or ``(file, line, source, conds)`` with conds ``[[file, line, text, kind], ...]``;
    it is interned per rank (ids differ across ranks, as in real traces). ``exits[r]``: the exit
    record (default normal), or None for none (killed). Ranks in ``dumps`` get a non-empty
    ``.stacks.txt`` (a SIGTERM stack dump)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    exits = exits or {}
    world = world if world is not None else max(ranks) + 1
    for rank, recs in ranks.items():
        sites: dict[tuple, int] = {}
        head = [{"t": "header", "schema": 1, "run": run, "rank": rank, "world": world, "host": "h",
                 "pid": 1000 + rank, "attempt": 0, "torch": "2.x", "backend": "gloo", "wall0": wall0},
                {"t": "init", "g": "0", "rank": rank, "world": world, "ts": 10}]
        body = []
        ts = 100
        for rec in recs:
            rec = dict(rec)
            ts = rec.setdefault("ts", ts + 1000)
            s = rec.get("site")
            if isinstance(s, (tuple, list)):
                key = (s[0], s[1], s[2] if len(s) > 2 else "")
                if key not in sites:
                    sid = sites[key] = 7 * rank + 100 + len(sites)
                    head.append({"t": "site", "id": sid, "file": s[0], "line": s[1], "func": "main",
                                 "src": key[2], "stack": [[s[0], s[1], "main", key[2]]],
                                 "conds": [list(c) for c in s[3]] if len(s) > 3 else []})
                rec["site"] = sites[key]
            for inf in (rec.get("inflight") or []):
                if isinstance(inf[3], (tuple, list)):
                    inf[3] = sites.get((inf[3][0], inf[3][1], inf[3][2] if len(inf[3]) > 2 else ""), 0)
            body.append(rec)
        ex = exits.get(rank, NORMAL)
        if ex is not None:
            ex = dict(ex)
            ex.setdefault("ts", ts + 1000)
            ex["inflight"] = [list(i) for i in ex.get("inflight") or []]
            for inf in ex["inflight"]:
                if isinstance(inf[3], (tuple, list)):
                    s = inf[3]
                    inf[3] = sites.get((s[0], s[1], s[2] if len(s) > 2 else ""), 0)
            body.append(ex)
        name = f"rank{rank:05d}-h-{1000 + rank}-a0"
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in head + body))
        (folder / f"{name}.stacks.txt").write_text(
            "Current thread 0x1 (most recent call first):\n  File \"train.py\", line 9\n"
            if rank in dumps else "")
    return folder


def context(folder, select=None) -> Context:
    ctx = Context(load_run([str(folder)]))
    if select is not None:
        ctx.selected = set(select)
    return ctx


def run_checks(folder, *ids: str, select=None) -> list:
    """Findings of the checks ``ids`` (all when empty), run on one shared context like a report;
    ``select`` restricts the checks the context says are running (default: all)."""
    ctx = context(folder, select)
    out = []
    for c in all_checks():
        if not ids or c.id in ids:
            out.extend(c.run(ctx))
    return out


def coll(s: int, op: str = "all_reduce", site=("train.py", 27), g: str = "0", d: int = 100, **extra) -> dict:
    """A sequence event."""
    return {"t": "c", "op": op, "g": g, "s": s, "d": d, "site": site, **extra}


def ddp_record(g: str = "0", site=("train.py", 20)) -> dict:
    return {"t": "ddp", "g": g, "s": 1, "site": site, "nparams": 2, "names": "n", "init_fp": "f",
            "nbuffers": 0, "broadcast_buffers": True, "find_unused": False, "params": []}


def ddp_steps(n: int, start: int = 2, g: str = "0", site=("train.py", 30, "loss = model(x)"),
              fwd_comm: bool = False, d: int = 100) -> list[dict]:
    """``n`` training steps: a forward (communicating or not) and a backward each."""
    out: list[dict] = []
    s = start
    for i in range(n):
        if fwd_comm:
            out.append({"t": "c", "op": "ddp_forward", "g": g, "s": s, "d": d, "site": site,
                        "step": i + 1, "grad": 1})
            s += 1
        else:
            out.append({"t": "e", "op": "ddp_forward", "g": g, "s": 0, "d": 10, "site": site,
                        "step": i + 1, "grad": 1})
        out.append({"t": "c", "op": "ddp_backward", "g": g, "s": s, "d": d, "site": site, "step": i + 1})
        s += 1
    return out
