"""``ddpdoctor timeline``: Chrome Trace Event output checked against the format's rules on small
hand-made trace files (the real traced runs are in tests/e2e/test_timeline_runs.py)."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest
from support.timeline_checks import _strict_load, check_format, process_of, run_timeline
from support.traces import site_record as site
from support.traces import timed_coll as coll
from support.traces import write_rank

from ddpdoctor.render import timeline


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
