"""Collectives issued by library code (FSDP2's all-gathers and reduce-scatters): the repeat
calls, recorded from a cached ``Hit`` per (caller, arguments, user site) (rank/patches/
libcalls.py), write what the general path writes for the first call, each at the user's line
that reached it, and the program computes what it computes untraced."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.jobs import read_records, run_bounded, torchrun, trace
from test_trace_ops import markers

PROG = Path(__file__).resolve().parent / "programs" / "fsdp_library_sites.py"
STEPS = 5


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    pytest.importorskip("torch.distributed.fsdp", reason="no FSDP2 in this torch")
    base = tmp_path_factory.mktemp("libcalls")
    out, traced, plain = base / "trace", base / "traced", base / "plain"
    traced.mkdir()
    plain.mkdir()
    res = trace(torchrun(PROG, str(traced)), out, "--no-report")
    assert res.returncode == 0, res.stdout + res.stderr
    res = run_bounded(torchrun(PROG, str(plain)), timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    return {"recs": {r: read_records(out, r) for r in (0, 1)}, "lines": markers(PROG),
            "traced": {r: json.loads((traced / f"result-rank{r}.json").read_text()) for r in (0, 1)},
            "plain": {r: json.loads((plain / f"result-rank{r}.json").read_text()) for r in (0, 1)}}


def test_results_are_unchanged(job):
    assert job["traced"] == job["plain"]


def _steps(recs: list[dict], lines: dict) -> list[list[tuple]]:
    """Per training step, the FSDP collectives as (op, group, tensors, user line), without the
    numbers that change from call to call (s, ts, d)."""
    sites = {r["id"]: r for r in recs if r["t"] == "site"}
    steps: list[list[tuple]] = [[]]
    for r in recs:
        if r["t"] != "c":
            continue
        site = sites[r["site"]]
        if site["file"] == str(PROG) and site["line"] == lines["step"]:
            steps.append([])
            continue
        if site["file"] != str(PROG) or site["line"] not in (lines["fwd"], lines["fwd2"], lines["bwd"]):
            continue
        rest = {k: v for k, v in r.items() if k not in ("s", "ts", "d")}
        steps[-1].append((r["op"], json.dumps(rest, sort_keys=True), site["line"]))
    return steps[:-1]


@pytest.mark.parametrize("rank", [0, 1])
def test_repeat_calls_record_what_the_first_call_recorded_at_the_users_line(job, rank):
    lines = job["lines"]
    steps = _steps(job["recs"][rank], lines)
    assert len(steps) == STEPS
    for i, step in enumerate(steps):
        fwd = lines["fwd2"] if i % 2 else lines["fwd"]
        assert step, i
        assert {line for _, _, line in step} == {fwd, lines["bwd"]}, i
        assert any(op.startswith("all_gather") for op, _, line in step if line == fwd)
        assert any(op.startswith("reduce_scatter") for op, _, line in step if line == lines["bwd"])
        # the same records as the first step of the same forward line (general path there)
        first = steps[i % 2]
        assert step == first, i
    # one site per user line: the same FSDP line reached from L:fwd and L:fwd2 is two sites
    sites = {r["site"] for r in job["recs"][rank] if r["t"] == "c" and r["op"].startswith("all_gather")}
    assert len(sites) >= 3  # fwd, fwd2 and the backward's re-gather
