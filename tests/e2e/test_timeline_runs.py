"""``ddpdoctor timeline`` on real traced runs (a divergent branch, a correct mixed job), checked
against the Chrome Trace Event format's rules."""

from __future__ import annotations

from collections import defaultdict

import pytest
from support.timeline_checks import _strict_load, check_format, process_of, run_timeline
from support.timeline_runs import divergent_run, mixed_run


# -- real runs ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def divergent(tmp_path_factory):
    trace_dir = divergent_run(tmp_path_factory)
    out = tmp_path_factory.mktemp("tl-div") / "run.json"
    res = run_timeline(trace_dir, out)
    assert res.returncode == 0, res.stderr
    assert "events written" in res.stderr
    return trace_dir, check_format(_strict_load(out))


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    trace_dir = mixed_run(tmp_path_factory)
    out = tmp_path_factory.mktemp("tl-mixed") / "run.json"
    res = run_timeline(trace_dir, out)
    assert res.returncode == 0, res.stderr
    return trace_dir, check_format(_strict_load(out))


def test_divergent_run_slices_markers_and_findings(divergent):
    _dir, events = divergent
    p0, p1 = process_of(events, 0), process_of(events, 1)
    assert p0 != p1

    def slices(pid, name):
        return [e for e in events if e["ph"] == "X" and e["pid"] == pid and e["name"] == name]

    # One slice per call, with op, group, sequence number, shapes and call site.
    ar0 = sorted(slices(p0, "all_reduce"), key=lambda e: e["args"]["seq"])
    assert [e["args"]["seq"] for e in ar0] == [1, 2, 3, 4]
    assert ar0[0]["args"]["group"] == "0" and ar0[0]["args"]["shapes"] == ["float32[4]"]
    assert "divergent_branch.py:19" in ar0[0]["args"]["call_site"]
    # The diverging call: rank 0's all_reduce #4 waited out the 5 s process-group timeout.
    last = ar0[-1]
    assert last["args"]["shapes"] == ["float32[1]"]
    assert "divergent_branch.py:21" in last["args"]["call_site"]
    assert "error" in last["args"] and last["dur"] >= 4_000_000
    (bar1,) = slices(p1, "barrier")
    assert bar1["args"]["seq"] == 4 and bar1["dur"] >= 4_000_000
    # Crash points of both ranks, and the finding on both ranks it concerns, at their call #4.
    for pid, call in ((p0, last), (p1, bar1)):
        marks = [e for e in events if e["ph"] == "i" and e["pid"] == pid]
        crash = [e for e in marks if e["name"].startswith("crash: RuntimeError")]
        assert len(crash) == 1 and crash[0]["ts"] >= call["ts"] + 4_000_000
        found = [e for e in marks if "DD001" in e["name"]]
        assert len(found) == 1, marks
        assert found[0]["ts"] == call["ts"]
        assert found[0]["args"]["category"] == "divergent-collectives" and found[0]["args"]["fix"]


def test_mixed_run_every_kind_and_wall_clock_alignment(mixed):
    _dir, events = mixed
    p0, p1 = process_of(events, 0), process_of(events, 1)
    xs = [e for e in events if e["ph"] == "X"]
    names = defaultdict(set)
    for e in xs:
        names[e["pid"]].add(e["name"])
    for pid in (p0, p1):
        assert {"all_reduce", "barrier", "wait all_reduce", "ddp_init", "ddp_forward", "ddp_backward"} <= names[pid]
    assert "send 0>1" in names[p0] and "recv 0>1" in names[p1]
    # Rank 1 sleeps 0.4 s before the last all_reduce: rank 0 waits inside it, and on the common
    # (wall-clock) axis both calls end together while rank 1's starts about 0.4 s later.
    last = {pid: max((e for e in xs if e["pid"] == pid and e["name"] == "all_reduce"),
                     key=lambda e: e["args"]["seq"]) for pid in (p0, p1)}
    a0, a1 = last[p0], last[p1]
    assert a0["args"]["seq"] == a1["args"]["seq"]
    assert a0["dur"] >= 250_000 and a1["dur"] < a0["dur"] - 200_000
    assert a1["ts"] - a0["ts"] >= 250_000
    assert abs((a0["ts"] + a0["dur"]) - (a1["ts"] + a1["dur"])) < 100_000
    # A correct run: no findings, normal exits.
    assert not any(e["ph"] == "i" and e["args"].get("id") for e in events)
    assert sum(1 for e in events if e["ph"] == "i" and e["name"] == "exit") == 2


def test_rank_and_window_filters(mixed, tmp_path):
    trace_dir, events = mixed
    res = run_timeline(trace_dir, tmp_path / "r1.json", "--ranks", "1")
    assert res.returncode == 0, res.stderr
    only1 = check_format(_strict_load(tmp_path / "r1.json"))
    procs = [e["args"]["name"] for e in only1 if e["name"] == "process_name"]
    assert len(procs) == 1 and procs[0].startswith("rank 1 (")
    assert {e["pid"] for e in only1} == {process_of(events, 1)}
    # A window around the last all_reduce only: everything kept overlaps it, and it is kept.
    xs = [e for e in events if e["ph"] == "X" and e["name"] == "all_reduce"]
    last = max(xs, key=lambda e: (e["args"]["seq"], e["dur"]))
    lo, hi = (last["ts"] + 1000) / 1e6, (last["ts"] + 2000) / 1e6
    res = run_timeline(trace_dir, tmp_path / "w.json", "--window", f"{lo:.6f}:{hi:.6f}")
    assert res.returncode == 0, res.stderr
    win = check_format(_strict_load(tmp_path / "w.json"))
    kept = [e for e in win if e["ph"] != "M"]
    assert any(e["ph"] == "X" and e["name"] == "all_reduce" and e["args"]["seq"] == last["args"]["seq"]
               for e in kept)
    for e in kept:
        assert e["ts"] <= hi * 1e6 and e["ts"] + e.get("dur", 0) >= lo * 1e6, e
    assert len(kept) < len([e for e in events if e["ph"] != "M"])


