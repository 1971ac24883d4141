"""Traced runs shared by tests/unit/test_timeline.py and tests/e2e/test_html_report.py (each torchrun launch
costs seconds on this machine: the same run serves both modules within one pytest session)."""

from __future__ import annotations

from pathlib import Path

from support.jobs import ROOT, torchrun, trace

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
