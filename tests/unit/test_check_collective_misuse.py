"""collective-misuse (DD012): collectives outside the process group's lifetime, and groups created
with different member lists.

Unit tests on hand-written traces (the bad/good programs run end to end in tests/e2e)."""

from __future__ import annotations

from support.traces import NO_PG, coll, raised, run_checks, write_run

DESTROY = {"t": "pg", "op": "destroy", "g": "0", "site": ("train.py", 19, "dist.destroy_process_group()")}
LATE = ("train.py", 36, "dist.all_reduce(metric)")


def test_collective_after_destroy_on_every_rank(tmp_path):
    ranks = {r: [coll(1), coll(2), DESTROY, coll(3, site=LATE, err=NO_PG)] for r in (0, 1)}
    folder = write_run(tmp_path, ranks, exits={r: raised(NO_PG, line=36) for r in (0, 1)})
    found = run_checks(folder)
    assert [f.id for f in found if f.severity == "error"] == ["DD012"]  # not rank-failed as well
    f = [x for x in found if x.id == "DD012"][0]
    assert f.ranks == [0, 1] and f.data == {"kind": "lifetime", "when": "after", "op": "all_reduce"}
    assert "called all_reduce at train.py:36 main() after destroy_process_group() at train.py:19" in f.message
    assert "Default process group has not been initialized" in f.message
    assert {(loc.role, loc.line) for loc in f.locations} == {("call", 36), ("destroy", 19)}


def test_one_rank_after_destroy_is_not_also_a_divergence(tmp_path):
    ranks = {0: [coll(1), DESTROY], 1: [coll(1), DESTROY, coll(2, site=LATE, err=NO_PG)]}
    folder = write_run(tmp_path, ranks, exits={1: raised(NO_PG, line=36)})
    found = run_checks(folder, "DD001", "DD008", "DD012")
    assert [(f.id, f.ranks) for f in found] == [("DD012", [1])]


def test_before_init_and_a_non_collective_call_after_destroy(tmp_path):
    # a caught call before init_process_group: its record precedes the init record in time
    early = coll(1, site=("train.py", 5), err=NO_PG, ts=1)
    ranks = {0: [early], 1: []}
    found = run_checks(write_run(tmp_path / "a", ranks), "DD012")
    assert [f.data["when"] for f in found] == ["before"] and found[0].ranks == [0]
    # dist.get_rank() after destroy raised outside any recorded call: the exit record tells
    ranks = {r: [coll(1), DESTROY] for r in (0, 1)}
    exits = {1: raised(NO_PG, line=44, func="log_metrics")}
    found = run_checks(write_run(tmp_path / "b", ranks, exits=exits), "DD012")
    assert len(found) == 1 and found[0].ranks == [1] and found[0].locations[0].line == 44
    assert "after destroy_process_group()" in found[0].message


def test_groups_with_different_members(tmp_path):
    made = ("train.py", 27, "mine = dist.new_group([rank])")
    ranks = {r: [coll(1, "new_group", made), {"t": "pg", "op": "new_group", "g": "1", "ranks": [r], "site": made}]
             for r in (0, 1)}
    found = run_checks(write_run(tmp_path, ranks), "DD012")
    assert len(found) == 1 and found[0].data == {"kind": "members", "group": "1"} and found[0].ranks == [0, 1]
    assert "rank 0 created it with members [0]" in found[0].message
    assert "rank 1 created it with members [1]" in found[0].message
    assert found[0].locations[0].line == 27


def test_consistent_groups_are_silent(tmp_path):
    # every rank creates [0,1] and [2,3]; members write a record, non-members none
    ranks = {}
    for r in range(4):
        recs = [coll(1, "new_group"), coll(2, "new_group")]
        g, members = ("1", [0, 1]) if r < 2 else ("2", [2, 3])
        recs.append({"t": "pg", "op": "new_group", "g": g, "ranks": members, "site": ("t.py", 3)})
        recs.append({"t": "pg", "op": "destroy", "g": g})
        ranks[r] = recs
    assert run_checks(write_run(tmp_path, ranks), "DD012") == []
