"""rank-failed (DD008): a rank raised or was killed while the others were in a collective; the
root cause is told apart from the collateral failures.

Unit tests on hand-written traces (the bad/good programs run end to end in tests/e2e)."""

from __future__ import annotations

from support.traces import GLOO_CLOSED, GLOO_TIMEOUT, NO_PG, coll, raised, run_checks, write_run

AR = ("train.py", 27, "dist.all_reduce(x)")


def steps(n: int) -> list[dict]:
    return [coll(s, site=AR) for s in range(1, n + 1)]


def failing(n: int, err: str) -> dict:
    """Collective #n that raised ``err``."""
    return coll(n, site=AR, err=err)


def test_root_cause_and_collateral(tmp_path):
    folder = write_run(tmp_path, {0: steps(2) + [failing(3, GLOO_CLOSED)], 1: steps(2)},
                       exits={0: raised(GLOO_CLOSED, line=27), 1: raised("ValueError: corrupt sample",
                                                                        line=17, func="load")})
    found = run_checks(folder, "DD008", "DD001")
    assert [f.id for f in found] == ["DD008"]  # the divergence it causes is not reported twice
    f = found[0]
    assert f.ranks == [1] and f.data["collateral"] == [0] and f.data["exc"].startswith("ValueError")
    assert f.message.startswith("Rank 1 raised ValueError: corrupt sample at train.py:17 in load()")
    assert "rank 0 was waiting in all_reduce #3 at train.py:27" in f.message
    assert "Connection closed by peer" in f.message and "[/pytorch" not in f.message
    assert "collateral" in f.message
    assert [(loc.role, loc.rank, loc.line) for loc in f.locations] == [
        ("exception", 1, 17), ("last call", 1, 27), ("waiting", 0, 27)]


def test_timeouts_everywhere_are_a_hang_not_a_failure(tmp_path):
    ranks = {0: steps(3) + [failing(4, GLOO_TIMEOUT)], 1: steps(3) + [coll(4, "barrier", err=GLOO_TIMEOUT)]}
    exits = {r: raised(GLOO_TIMEOUT, line=27) for r in (0, 1)}
    assert run_checks(write_run(tmp_path / "a", ranks, exits=exits), "DD008") == []
    # one rank timed out, the launcher then killed the other (no exit record): still a hang
    exits = {0: raised(GLOO_TIMEOUT, line=27), 1: None}
    assert run_checks(write_run(tmp_path / "b", ranks, exits=exits, dumps=(1,)), "DD008") == []


def test_killed_rank_is_the_root_cause_when_its_peer_saw_it_go(tmp_path):
    folder = write_run(tmp_path, {0: steps(2) + [failing(3, GLOO_CLOSED)], 1: steps(2)},
                       exits={0: raised(GLOO_CLOSED), 1: None})
    found = run_checks(folder, "DD008")
    assert len(found) == 1 and found[0].ranks == [1] and found[0].data["how"] == "killed"
    assert "without an exit record" in found[0].message and found[0].data["collateral"] == [0]


def test_killed_ranks_told_apart_by_the_sigterm_dump(tmp_path):
    # both killed; rank 0 wrote a SIGTERM stack dump (the launcher ended it), rank 1 did not
    folder = write_run(tmp_path / "a", {0: steps(3), 1: steps(2)}, exits={0: None, 1: None}, dumps=(0,))
    found = run_checks(folder, "DD008")
    assert [f.ranks for f in found] == [[1]]
    # every rank killed the same way, nothing else: ended from outside, no culprit to name
    folder = write_run(tmp_path / "b", {0: steps(3), 1: steps(2)}, exits={0: None, 1: None})
    assert run_checks(folder, "DD008") == []


def test_killed_after_the_last_collective_with_nobody_waiting_is_silent(tmp_path):
    folder = write_run(tmp_path, {0: steps(3), 1: steps(3)}, exits={1: None})  # os._exit(0) at the end
    assert run_checks(folder, "DD008") == []


def test_users_own_errors_are_root_causes_even_if_they_say_timeout(tmp_path):
    exits = {0: raised(GLOO_CLOSED), 1: raised("TimeoutError: timed out fetching s3://bucket/shard", line=8)}
    folder = write_run(tmp_path / "a", {0: steps(2) + [failing(3, GLOO_CLOSED)], 1: steps(2)}, exits=exits)
    assert [f.ranks for f in run_checks(folder, "DD008")] == [[1]]
    # a RuntimeError raised outside any collective is the user's, even with "timed out" in it
    exits = {0: raised(GLOO_CLOSED), 1: raised("RuntimeError: DataLoader timed out after 5 seconds")}
    folder = write_run(tmp_path / "b", {0: steps(2) + [failing(3, GLOO_CLOSED)], 1: steps(2)}, exits=exits)
    assert [f.ranks for f in run_checks(folder, "DD008")] == [[1]]


def test_misuse_errors_are_left_to_collective_misuse(tmp_path):
    ranks = {r: steps(2) + [{"t": "pg", "op": "destroy", "g": "0", "site": ("train.py", 30)},
                            coll(3, site=("train.py", 31), err=NO_PG)] for r in (0, 1)}
    folder = write_run(tmp_path, ranks, exits={r: raised(NO_PG, line=31) for r in (0, 1)})
    assert [f.id for f in run_checks(folder, "DD008", "DD012")] == ["DD012"]
    alone = run_checks(folder, "DD008", select={"DD008"})
    assert [f.id for f in alone] == ["DD008"] and "Every rank failed the same way" in alone[0].message


def test_distinct_root_causes_and_the_first_one(tmp_path):
    ranks = {0: steps(2) + [failing(3, GLOO_CLOSED)], 1: steps(2), 2: steps(1)}
    exits = {0: raised(GLOO_CLOSED), 1: dict(raised("KeyError: 'label'", line=40), ts=9000),
             2: dict(raised("ValueError: nan", line=50), ts=5000)}
    found = run_checks(write_run(tmp_path, ranks, exits=exits), "DD008")
    assert sorted(f.ranks[0] for f in found) == [1, 2]
    first = [f for f in found if "(the first failure)" in f.message]
    assert [f.ranks for f in first] == [[2]]


def test_hang_kill_is_not_a_rank_failure(tmp_path):
    ranks = {0: steps(3), 1: steps(2)}
    exits = {r: {"t": "exit", "how": "hang-kill", "inflight": [["all_reduce", "0", 3, AR, 5]]} for r in (0, 1)}
    assert run_checks(write_run(tmp_path, ranks, exits=exits), "DD008") == []


def test_exception_in_a_process_that_lived_on_until_the_hang_kill(tmp_path):
    # rank 1's main thread raised, a non-daemon thread kept it alive, the watchdog ended it
    kill = {"t": "exit", "how": "hang-kill", "inflight": []}
    ranks = {0: steps(1), 1: steps(1) + [raised("ValueError: bad batch on rank 1", line=44)]}
    exits = {0: dict(kill, inflight=[["all_reduce", "0", 2, AR, 5]]), 1: kill}
    found = run_checks(write_run(tmp_path, ranks, exits=exits), "DD008", "DD001")
    assert [(f.id, f.ranks) for f in found] == [("DD008", [1])]
    assert "ValueError: bad batch on rank 1" in found[0].message and found[0].locations[0].line == 44
    assert "rank 0 was waiting in all_reduce #2" in found[0].message


def test_hundreds_of_ranks_one_culprit(tmp_path):
    world = 256
    ranks = {r: steps(5) + ([failing(6, GLOO_CLOSED)] if r != 3 else []) for r in range(world)}
    exits = {r: raised(GLOO_CLOSED) for r in range(world)}
    exits[3] = raised("RuntimeError: CUDA error: an illegal memory access", line=90)
    found = run_checks(write_run(tmp_path, ranks, exits=exits), "DD008", "DD001")
    assert [f.id for f in found] == ["DD008"] and found[0].ranks == [3]
    assert "ranks 0-2,4-255 were waiting in all_reduce #6" in found[0].message
    assert len(found[0].data["collateral"]) == 255 and len(found[0].message) < 1000
