"""The one builder of hand-written trace folders for unit tests: rank files written with the trace
contract's record encoders (``ddpdoctor.trace.records``), as the recorder writes them — a header,
interned call sites, the records, an exit record — then loaded and checked in-process.

Three front ends keep the defaults the tests were written against:

- :func:`write_run` (checks of failures and endings): an ``init`` record, sites with their branch
  headers, in-flight calls, exit records chosen per rank, stack dumps;
- :func:`write_traces` (checks of rare records: seeds, samplers, files): sites for ``site`` and
  ``created`` fields, timestamps 1000 µs apart;
- :func:`write_rank` (timeline and HTML readers): the records exactly as given.
"""

from __future__ import annotations

import json
from pathlib import Path

from ddpdoctor.analysis.checks import all_checks
from ddpdoctor.analysis.checks.base import Context
from ddpdoctor.analysis.run import load_run
from ddpdoctor.trace import records
from ddpdoctor.trace.files import STACKS_SUFFIX, SUFFIX

NORMAL = {"t": "exit", "how": "normal"}
GLOO_CLOSED = ("RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
               "closed by peer [127.0.0.1]:4242. This is typically caused by a remote worker crashing.")
GLOO_TIMEOUT = ("RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] "
                "Timed out waiting 5000ms for recv operation to complete")
NO_PG = ("ValueError: Default process group has not been initialized, please make sure to call "
         "init_process_group.")


# -- the builder ----------------------------------------------------------------------------------
class Sites:
    """Interns ``(file, line[, source[, conds]])`` tuples into site records with per-rank ids
    (ids deliberately differ across ranks, as they do in real traces)."""

    def __init__(self, rank: int, with_conds: bool) -> None:
        self.rank = rank
        self.with_conds = with_conds
        self.ids: dict[tuple, int] = {}
        self.records: list[dict] = []

    def key(self, s) -> tuple:
        return (s[0], s[1], s[2] if len(s) > 2 else "")

    def intern(self, s) -> int:
        key = self.key(s) if self.with_conds else tuple(s)
        if key not in self.ids:
            sid = self.ids[key] = 7 * self.rank + 100 + len(self.ids)
            src = s[2] if len(s) > 2 else ""
            conds = ([list(c) for c in s[3]] if len(s) > 3 else []) if self.with_conds else None
            self.records.append(records.site(sid, s[0], s[1], "main", src, conds=conds))
        return self.ids[key]

    def lookup(self, s) -> int:
        return self.ids.get(self.key(s), 0)


def write_rank_file(folder: Path, name: str, lines: list[dict], stacks: str | None = None) -> Path:
    """One rank file (``name`` without suffix) and, when given, its stack dump."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}{SUFFIX}"
    # json.dumps' default spacing, not the recorder's compact form: some tests edit the text
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    if stacks is not None:
        (folder / f"{name}{STACKS_SUFFIX}").write_text(stacks)
    return path


def header(rank: int, world: int, *, run: str, host: str, pid: int, torch: str, wall0: float) -> dict:
    return records.header(run=run, rank=rank, world=world, host=host, pid=pid, attempt=0, torch=torch,
                          backend="gloo", wall0=wall0)


# -- front ends -----------------------------------------------------------------------------------
def write_run(folder, ranks: dict[int, list[dict]], exits: dict | None = None, world: int | None = None,
              run: str = "unit", dumps: tuple = (), wall0: float = 1.0) -> Path:
    """One trace file per rank. A record's ``site`` (and a sampler's ``created``) may be
    ``(file, line)``, ``(file, line, source)`` or ``(file, line, source, conds)`` with conds ``[[file, line, text, kind], ...]``.
    ``exits[r]``: the exit record (default normal), or None for none (killed). Ranks in ``dumps``
    get a non-empty ``.stacks.txt`` (a SIGTERM stack dump)."""
    folder = Path(folder)
    exits = exits or {}
    world = world if world is not None else max(ranks) + 1
    for rank, recs in ranks.items():
        sites = Sites(rank, with_conds=True)
        body = []
        ts = 100
        for rec in recs:
            rec = dict(rec)
            ts = rec.setdefault("ts", ts + 1000)
            for field in ("site", "created"):
                if isinstance(rec.get(field), (tuple, list)):
                    rec[field] = sites.intern(rec[field])
            for inf in (rec.get("inflight") or []):
                if isinstance(inf[3], (tuple, list)):
                    inf[3] = sites.lookup(inf[3])
            body.append(rec)
        ex = exits.get(rank, NORMAL)
        if ex is not None:
            ex = dict(ex)
            ex.setdefault("ts", ts + 1000)
            ex["inflight"] = [list(i) for i in ex.get("inflight") or []]
            for inf in ex["inflight"]:
                if isinstance(inf[3], (tuple, list)):
                    inf[3] = sites.lookup(inf[3])
            body.append(ex)
        head = [header(rank, world, run=run, host="h", pid=1000 + rank, torch="2.x", wall0=wall0),
                {"t": "init", "g": "0", "rank": rank, "world": world, "ts": 10}]
        stacks = ("Current thread 0x1 (most recent call first):\n  File \"train.py\", line 9\n"
                  if rank in dumps else "")
        write_rank_file(folder, f"rank{rank:05d}-h-{1000 + rank}-a0", head + sites.records + body, stacks)
    return folder


def write_traces(folder, ranks: dict[int, list[dict]], world: int | None = None, run: str = "unit",
                 hosts: dict[int, str] | None = None) -> Path:
    """One trace file per rank. A record's ``site`` (and a sampler's ``created``) may be given as
    ``(file, line)`` or ``(file, line, source)``; records get timestamps 1000 µs apart."""
    folder = Path(folder)
    world = world if world is not None else max(ranks) + 1
    for rank, recs in ranks.items():
        sites = Sites(rank, with_conds=False)
        body = []
        for i, rec in enumerate(recs):
            rec = dict(rec)
            rec.setdefault("ts", 1000 * (i + 1))
            for field in ("site", "created", "order"):
                if isinstance(rec.get(field), (tuple, list)):
                    rec[field] = sites.intern(rec[field])
            if isinstance(rec.get("dl"), list) and isinstance(rec["dl"][0], (tuple, list)):
                rec["dl"] = [sites.intern(rec["dl"][0]), rec["dl"][1]]  # a file read for a DataLoader pass
            body.append(rec)
        body.append(records.exit_record("normal", ts=10 ** 9))
        head = header(rank, world, run=run, host=(hosts or {}).get(rank, "h"), pid=1000 + rank, torch="2.x",
                      wall0=1.0)
        write_rank_file(folder, f"rank{rank:05d}-h-{1000 + rank}-a0", [head] + sites.records + body)
    return folder


def write_rank(folder: Path, rank: int, world: int, records_: list[dict], wall0: float = 1.7e9,
               run: str = "synthetic", exit_normal: bool = True) -> Path:
    """A hand-made rank file (header first, the records as given), for unit tests of the readers."""
    lines = [header(rank, world, run=run, host="testhost", pid=100 + rank, torch="test", wall0=wall0),
             *records_]
    if exit_normal:
        last = max((int(r.get("ts", 0)) + int(r.get("d", 0)) for r in records_), default=0)
        lines.append(records.exit_record("normal", ts=last + 10))
    return write_rank_file(folder, f"rank{rank:05d}-testhost-{100 + rank}-a0", lines)


# -- records --------------------------------------------------------------------------------------
def raised(exc: str, line: int = 17, file: str = "train.py", inflight=(), func: str = "main") -> dict:
    """An exit record for an uncaught exception."""
    return records.exit_record("exception", exc=exc, file=file, line=line, func=func,
                               stack=[[file, line, func, "x = load()"]], inflight=[list(i) for i in inflight])


def coll(s: int, op: str = "all_reduce", site=("train.py", 27), g: str = "0", d: int = 100, **extra) -> dict:
    """A sequence event."""
    return {"t": "c", "op": op, "g": g, "s": s, "d": d, "site": site, **extra}


def group_coll(g: str, s: int, op: str = "barrier", site=("train.py", 1), **extra) -> dict:
    """A sequence event, group first (the rare-record tests' spelling)."""
    return {"t": "c", "op": op, "g": g, "s": s, "d": 1, "site": site, **extra}


def timed_coll(op: str, s: int, ts: int, d: int, sid: int = 1, g: str = "0", **extra) -> dict:
    """A sequence event with its time and an explicit site id (the readers' tests)."""
    rec = {"t": "c", "op": op, "g": g, "s": s, "ts": ts, "d": d, "site": sid}
    if op not in ("barrier",):
        rec.update(x=["float32[4]"], n=4)
    if op == "all_reduce":
        rec["rop"] = "SUM"
    rec.update(extra)
    return rec


def site_record(sid: int, file: str = "/src/train.py", line: int = 10, func: str = "step",
                src: str = "dist.all_reduce(x)", conds: list | None = None) -> dict:
    """An explicit site record (the readers' tests)."""
    return records.site(sid, file, line, func, src, conds=conds or [])


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


# -- running checks -------------------------------------------------------------------------------
def context(folder, select=None) -> Context:
    ctx = Context(load_run([str(folder)]))
    if select is not None:
        ctx.selected = set(select)
    return ctx


def run_check(check_cls, folder) -> list:
    """Findings of one check over a trace folder."""
    return check_cls().run(Context(load_run([str(folder)])))


def run_checks(folder, *ids: str, select=None) -> list:
    """Findings of the checks ``ids`` (all when empty), run on one shared context like a report;
    ``select`` restricts the checks the context says are running (default: all)."""
    ctx = context(folder, select)
    out = []
    for c in all_checks():
        if not ids or c.id in ids:
            out.extend(c.run(ctx))
    return out
