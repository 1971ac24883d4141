"""End to end: the C repeat-call path (ddpdoctor/rank/_fastcall.c) writes the trace the Python
path writes. The same real 2-rank gloo program (repeat calls, keyword forms, async work, a
collective that raises every round), traced with the C path and with ``DDPDOCTOR_NATIVE=0``:
every record identical but for its timings."""

from __future__ import annotations

import json

import pytest
from support.jobs import read_records, torchrun, trace
from test_fastpath import PROG

pytest.importorskip("ddpdoctor.rank._fastcall", reason="C extension not built (no compiler)")

#: Fields that are times or durations, or name the process: they differ between any two runs.
TIMES = {"ts", "d", "t0", "wall", "pid", "time", "host", "start", "end", "elapsed"}


def _run(tmp_path, native: str) -> dict:
    out, results = tmp_path / f"trace{native}", tmp_path / f"results{native}"
    results.mkdir()
    res = trace(torchrun(PROG, str(results)), out, "--no-report", env={"DDPDOCTOR_NATIVE": native})
    assert res.returncode == 0, res.stdout + res.stderr
    recs = {}
    for r in (0, 1):
        recs[r] = [{k: v for k, v in rec.items() if k not in TIMES}
                   for rec in read_records(out, r) if rec["t"] in ("c", "site", "w")]
        recs[r].append(json.loads((results / f"result-rank{r}.json").read_text()))
    return recs


def test_records_identical_with_native_path_on_and_off(tmp_path):
    on, off = _run(tmp_path, "1"), _run(tmp_path, "0")
    for r in (0, 1):
        calls = [x for x in on[r] if x.get("t") == "c"]
        assert len(calls) > 20 and any("err" in x for x in calls)  # repeat calls, a failing one
        assert on[r] == off[r]


def test_collective_in_fullgraph_compile_still_traces(tmp_path):
    # what torch.distributed exposes stays a Python function Dynamo traces through
    prog = PROG.parent / "compiled_collective.py"
    res = trace(torchrun(prog, nproc=1), tmp_path / "trace", "--no-report", env={"DDPDOCTOR_NATIVE": "1"})
    assert res.returncode == 0, res.stdout + res.stderr
    assert "result [2.0, 2.0]" in res.stdout
