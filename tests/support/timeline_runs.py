"""Traced runs shared by tests/test_timeline.py and tests/test_html_report.py (each torchrun launch
costs seconds on this machine: the same run serves both modules within one pytest session)."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import ROOT, torchrun, trace

_CACHE: dict[str, Path] = {}


def _traced(name: str, tmp_path_factory, script: Path, env: dict) -> Path:
    if name not in _CACHE:
        out = tmp_path_factory.mktemp(name) / "trace"
        res = trace(torchrun(script), out, "--hang-timeout", "0", "--no-report", env=env, timeout=120)
        files = sorted(out.glob("rank*.jsonl")) if out.exists() else []
        assert len(files) == 2, f"{name}: expected 2 rank files, got {files}\n{res.stderr[-3000:]}"
        _CACHE[name] = out
    return _CACHE[name]


def divergent_run(tmp_path_factory) -> Path:
    """examples/divergent_branch.py: rank 0 issues an extra all_reduce #4, rank 1 a barrier #4;
    both fail at the 5 s process-group timeout."""
    return _traced("divergent", tmp_path_factory, ROOT / "examples" / "divergent_branch.py",
                   {"EXAMPLE_PG_TIMEOUT": "5"})


def mixed_run(tmp_path_factory) -> Path:
    """A correct job with collectives, async wait, p2p, DDP and a late rank (see tests/e2e/programs/timeline_mixed_ops.py)."""
    return _traced("mixed", tmp_path_factory, ROOT / "tests" / "e2e" / "programs" / "timeline_mixed_ops.py",
                   {"EXAMPLE_PG_TIMEOUT": "20", "TIMELINE_LATE_S": "0.4"})


def write_rank(folder: Path, rank: int, world: int, records: list[dict], wall0: float = 1.7e9,
               run: str = "synthetic", exit_normal: bool = True) -> Path:
    """A hand-made rank file (header first), for unit tests of the readers."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"rank{rank:05d}-testhost-{100 + rank}-a0.jsonl"
    header = {"t": "header", "schema": 1, "run": run, "rank": rank, "world": world, "host": "testhost",
              "pid": 100 + rank, "attempt": 0, "backend": "gloo", "torch": "test", "wall0": wall0}
    lines = [header, *records]
    if exit_normal:
        last = max((int(r.get("ts", 0)) + int(r.get("d", 0)) for r in records), default=0)
        lines.append({"t": "exit", "how": "normal", "ts": last + 10})
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


def site(sid: int, file: str = "/src/train.py", line: int = 10, func: str = "step",
         src: str = "dist.all_reduce(x)", conds: list | None = None) -> dict:
    return {"t": "site", "id": sid, "file": file, "line": line, "func": func, "src": src,
            "stack": [[file, line, func, src]], "conds": conds or []}


def coll(op: str, s: int, ts: int, d: int, sid: int = 1, g: str = "0", **extra) -> dict:
    rec = {"t": "c", "op": op, "g": g, "s": s, "ts": ts, "d": d, "site": sid}
    if op not in ("barrier",):
        rec.update(x=["float32[4]"], n=4)
    if op == "all_reduce":
        rec["rop"] = "SUM"
    rec.update(extra)
    return rec


