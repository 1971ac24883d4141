"""``ddpdoctor timeline``: Chrome Trace Event output checked against the format's rules, on real
traced runs (a divergent branch, a correct mixed job) and on small hand-made trace files."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from conftest import ROOT
from support.timeline_runs import coll, divergent_run, mixed_run, site, write_rank

from ddpdoctor.render import timeline


def run_timeline(trace_dir, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ddpdoctor", "timeline", str(trace_dir), "-o", str(out),
                           *extra], capture_output=True, text=True, timeout=120, cwd=str(ROOT))


def _strict_load(path: Path) -> dict:
    def no_constants(name):
        raise AssertionError(f"non-standard JSON constant {name} in {path}")

    with open(path, encoding="utf-8") as f:
        return json.load(f, parse_constant=no_constants)


def check_format(doc: dict) -> list[dict]:
    """The rules of the Trace Event format that viewers rely on; returns the events."""
    assert isinstance(doc, dict) and isinstance(doc.get("traceEvents"), list)
    assert doc.get("displayTimeUnit") in ("ms", "ns")
    events = doc["traceEvents"]
    named: dict[int, str] = {}
    sorted_pids = set()
    for ev in events:
        for key in ("ph", "pid", "tid", "ts", "name"):
            assert key in ev, f"{key} missing in {ev}"
        assert isinstance(ev["pid"], int) and ev["pid"] > 0, ev  # pid 0 is special to viewers
        assert isinstance(ev["tid"], int) and ev["tid"] > 0, ev
        assert isinstance(ev["ts"], (int, float)) and ev["ts"] >= 0, ev
        ph = ev["ph"]
        assert ph in ("X", "i", "M"), ev
        if ph == "X":
            assert isinstance(ev.get("dur"), (int, float)) and ev["dur"] >= 0, ev
            assert isinstance(ev.get("args"), dict) and ev["args"], ev
        elif ph == "i":
            assert ev.get("s") in ("t", "p", "g"), ev
            assert isinstance(ev.get("args"), dict), ev
        else:
            assert isinstance(ev.get("args"), dict), ev
            if ev["name"] == "process_name":
                named[ev["pid"]] = ev["args"]["name"]
            elif ev["name"] == "process_sort_index":
                sorted_pids.add(ev["pid"])
            elif ev["name"] in ("thread_name", "thread_sort_index"):
                pass
            else:
                raise AssertionError(f"unexpected metadata event {ev}")
    used = {ev["pid"] for ev in events}
    assert used == set(named), f"processes without a name: {used - set(named)}"
    assert used == sorted_pids
    # tids are unique across processes (viewers key threads by tid alone).
    owner: dict[int, int] = {}
    for ev in events:
        assert owner.setdefault(ev["tid"], ev["pid"]) == ev["pid"], f"tid {ev['tid']} in two processes"
    assert_nested(events)
    return events


def assert_nested(events: list[dict]) -> None:
    """Complete events of one thread must nest or be disjoint, or viewers drop/misdraw them."""
    by_tid: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for ev in events:
        if ev["ph"] == "X":
            by_tid[ev["tid"]].append((ev["ts"], ev["ts"] + ev["dur"]))
    for tid, ivs in by_tid.items():
        ivs.sort(key=lambda iv: (iv[0], -iv[1]))
        stack: list[int] = []
        for s, e in ivs:
            while stack and stack[-1] <= s:
                stack.pop()
            assert not stack or e <= stack[-1], f"tid {tid}: slice {s}-{e} overlaps its neighbour's end {stack[-1]}"
            stack.append(e)


def process_of(events: list[dict], rank: int) -> int:
    for ev in events:
        if ev["ph"] == "M" and ev["name"] == "process_name" and ev["args"]["name"].startswith(f"rank {rank} ("):
            return ev["pid"]
    raise AssertionError(f"no process for rank {rank}")


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


@pytest.mark.parametrize("opt,value", [("--ranks", "3-1"), ("--ranks", "a"), ("--ranks", "7"),
                                       ("--window", "20:10"), ("--window", "x:y"), ("--window", "5")])
def test_bad_filters_are_one_line_usage_errors(opt, value, tmp_path):
    d = tmp_path / "t"
    write_rank(d, 0, 1, [site(1), coll("all_reduce", 1, 100, 50)])
    res = run_timeline(d, tmp_path / "o.json", opt, value)
    assert res.returncode == 2
    err = res.stderr.strip()
    assert err.startswith("ddpdoctor: error:") and "\n" not in err and opt in err
    assert not (tmp_path / "o.json").exists()


# -- hand-made traces --------------------------------------------------------------------------
def test_wall_clock_alignment_hang_and_killed_rank(tmp_path):
    d = tmp_path / "t"
    # Rank 1 started its recorder 2 s after rank 0: equal local ts are 2 s apart on the axis.
    write_rank(d, 0, 2, [site(1), coll("all_reduce", 1, 1000, 500),
                         {"t": "pending", "op": "all_reduce", "g": "0", "s": 2, "site": 1, "ts": 2000,
                          "waited_s": 1.0},
                         {"t": "hang", "role": "reporter", "ep": 1, "ts": 3_000_000,
                          "status": {"state": "collective", "op": "all_reduce", "g": "0", "s": 2,
                                     "stacks": [{"main": True, "frames": [["f", 1, "g", "x" * 50]]}]},
                          "diag": {"verdict": "rank-gone", "group": "0", "seq": 2, "op": "all_reduce",
                                   "culprit": [1], "reason": "it exited"}}],
               wall0=1000.0, exit_normal=False)
    write_rank(d, 1, 2, [site(1), coll("all_reduce", 1, 1000, 500)], wall0=1002.0, exit_normal=False)
    out = tmp_path / "o.json"
    n = timeline.write([str(d)], str(out), ranks=None, window=None)
    events = check_format(_strict_load(out))
    assert n == len(events)
    p0, p1 = process_of(events, 0), process_of(events, 1)
    first = {e["pid"]: e for e in events if e["ph"] == "X" and e["args"].get("seq") == 1}
    assert first[p1]["ts"] - first[p0]["ts"] == 2_000_000
    # The call rank 0 never finished: a slice from its start to the rank's last sign of life.
    (open_call,) = [e for e in events if e["ph"] == "X" and e["args"].get("never_returned")]
    assert open_call["pid"] == p0 and open_call["ts"] == 2000 and open_call["ts"] + open_call["dur"] == 3_000_000
    names0 = {e["name"] for e in events if e["ph"] == "i" and e["pid"] == p0}
    assert {"pending: all_reduce #2", "hang diagnosed", "no exit record (killed?)"} <= names0
    hang = next(e for e in events if e["name"] == "hang diagnosed")
    assert hang["args"]["diagnosis"]["verdict"] == "rank-gone" and "stacks" not in json.dumps(hang["args"])


def test_partially_overlapping_calls_get_separate_lanes(tmp_path):
    d = tmp_path / "t"
    # Two threads of one rank: calls 1 and 2 overlap without nesting; 3 nests inside 2.
    write_rank(d, 0, 1, [site(1), coll("all_reduce", 1, 100, 1000), coll("broadcast", 2, 600, 1000, root=0),
                         coll("barrier", 3, 700, 100)])
    out = tmp_path / "o.json"
    timeline.write([str(d)], str(out))
    events = check_format(_strict_load(out))  # includes the nesting check per thread
    tids = {e["args"]["seq"]: e["tid"] for e in events if e["ph"] == "X"}
    assert tids[1] != tids[2]
    lanes = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert {"collectives", "collectives (2)"} <= lanes


def test_untrusted_values_stay_strict_json(tmp_path):
    d = tmp_path / "t"
    rec = coll("all_reduce", 1, 100, 50)
    rec["x"] = [float("nan")]  # json.dumps writes NaN, which strict JSON readers reject
    write_rank(d, 0, 1, [site(1, src='"</script><b>'), rec])
    out = tmp_path / "o.json"
    timeline.write([str(d)], str(out))
    events = check_format(_strict_load(out))
    (x,) = [e for e in events if e["ph"] == "X"]
    assert x["args"]["source"] == '"</script><b>'


def test_parse_filters():
    assert timeline.parse_ranks("0-3,8") == {0, 1, 2, 3, 8}
    assert timeline.parse_ranks(None) is None
    assert timeline.parse_window("10:20") == (10e6, 20e6)
    assert timeline.parse_window(":2.5") == (0.0, 2.5e6)
    assert timeline.parse_window("3:")[1] == float("inf")
    for bad in ("-1", "2-1", "x", ","):
        with pytest.raises(ValueError):
            timeline.parse_ranks(bad)
    for bad in ("5", "5:5", "-1:2", "nan:3", "a:b"):
        with pytest.raises(ValueError):
            timeline.parse_window(bad)


def test_lanes_keep_every_thread_well_nested():
    """Random intervals (as calls from several threads could produce): on every lane any two
    slices are disjoint or one contains the other, and a proper nesting needs no second lane."""
    import random

    rnd = random.Random(7)
    for _ in range(200):
        lanes = timeline._Lanes()
        placed: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for _ in range(60):
            s = rnd.randint(0, 300)
            e = s + rnd.choice([0, 1, 5, 20, 80, 200])
            lane = lanes.place(s, e)
            for s2, e2 in placed[lane]:
                assert e <= s2 or e2 <= s or (s <= s2 and e2 <= e) or (s2 <= s and e <= e2), (s, e, s2, e2)
            placed[lane].append((s, e))
    nested = timeline._Lanes()
    assert {nested.place(s, e) for s, e in [(10, 20), (0, 100), (30, 40), (32, 35), (200, 300)]} == {0}
