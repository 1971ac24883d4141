"""End to end: repeat calls from one call site (rank/patches/fastpath.py) are recorded exactly
like the first call from it (the general path), one event each, at the right call site."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest
from support.jobs import read_records, torchrun, trace
from test_trace_ops import markers

PROG = Path(__file__).resolve().parent / "programs" / "fastpath_sites.py"
ROUNDS = 4


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    base = tmp_path_factory.mktemp("fast")
    out, results = base / "trace", base / "results"
    results.mkdir()
    res = trace(torchrun(PROG, str(results)), out, "--no-report")
    assert res.returncode == 0, res.stdout + res.stderr
    traced = {r: json.loads((results / f"result-rank{r}.json").read_text()) for r in (0, 1)}
    return {"recs": {r: read_records(out, r) for r in (0, 1)}, "seen": traced, "lines": markers(PROG)}


def by_line(recs: list[dict]) -> dict[int, list[dict]]:
    sites = {r["id"]: r for r in recs if r["t"] == "site"}
    out: dict[int, list[dict]] = defaultdict(list)
    for r in recs:
        if r["t"] == "c" and sites[r["site"]]["file"] == str(PROG):
            out[sites[r["site"]]["line"]].append(r)
    return out


def test_results_are_unchanged(job):
    # what each rank computed: what the same program computes untraced
    for r in (0, 1):
        seen = job["seen"][r]
        assert seen["errors"] == [seen["errors"][0]] * ROUNDS  # the same error every round
        assert seen["sums"] == [[2.0] * (1 + i % 2) for i in range(ROUNDS)]
        assert seen["maxes"] == [[float(1 + i)] for i in range(ROUNDS)]


@pytest.mark.parametrize("rank", [0, 1])
def test_every_repeat_call_is_one_full_event(job, rank):
    lines, ev = job["lines"], by_line(job["recs"][rank])
    # twin helpers (same bytecode, same offsets in their callers): two call sites
    assert len(ev[lines["a"]]) == len(ev[lines["b"]]) == ROUNDS
    assert {e["site"] for e in ev[lines["a"]]}.isdisjoint({e["site"] for e in ev[lines["b"]]})
    assert [e["x"] for e in ev[lines["a"]]] == [["float32[1]"]] * ROUNDS
    assert [e["x"] for e in ev[lines["b"]]] == [["float32[2]"]] * ROUNDS
    # shape and dtype change between calls from one line: each call described as it was made
    assert [(e["x"], e["n"]) for e in ev[lines["shapes"]]] == [
        (["float32[1]"], 1), (["float32[2]"], 2), (["float64[1]"], 1), (["float64[2]"], 2)]
    assert [e["rop"] for e in ev[lines["max"]] + ev[lines["max_pos"]]] == ["MAX"] * ROUNDS
    assert all(e.get("async") == 1 for e in ev[lines["async"]]) and len(ev[lines["async"]]) == ROUNDS
    bad = ev[lines["bad_src"]]
    assert len(bad) == ROUNDS and all(e.get("err") and e["root"] == 5 for e in bad), bad
    # the same fields, first call (general path) and repeats (fast path), bar the numbers
    for evs in ev.values():
        shapes = {tuple(sorted(set(e) - {"s", "ts", "d"})) for e in evs}
        assert len(shapes) == 1, evs
    # one sequence: every number once, in order
    seq = sorted(e["s"] for e in job["recs"][rank] if e["t"] == "c" and e["g"] == "0")
    assert seq == list(range(1, len(seq) + 1))
