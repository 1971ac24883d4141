"""missing-barrier (DD003): happens-before of file operations from collective positions.

Unit tests on hand-written traces (the bad/good programs run end to end in tests/e2e)."""

from __future__ import annotations

import time

from support.traces import run_check, write_traces

from ddpdoctor.analysis.checks.missing_barrier import MissingBarrier

CK = "/ckpt/model.pt"


def f(op: str, path: str, pos: dict, line: int, **extra) -> dict:
    return {"t": "file", "op": op, "path": path, "pos": pos, "site": ("train.py", line), **extra}


def check(tmp_path, ranks, world=None):
    return run_check(MissingBarrier, write_traces(tmp_path / "t", ranks, world))


def test_barrier_between_save_and_load_is_silent(tmp_path):
    # if rank == 0: torch.save(...); dist.barrier(); torch.load(...) on all ranks
    assert check(tmp_path, {0: [f("w", CK, {}, 10), f("r", CK, {"0": 1}, 12)],
                            1: [f("r", CK, {"0": 1}, 12)]}) == []


def test_write_and_read_between_the_same_collectives_is_a_race(tmp_path):
    found = check(tmp_path, {0: [f("w", CK, {"0": 1}, 10)], 1: [f("r", CK, {"0": 1}, 12)]})
    assert len(found) == 1
    fd = found[0]
    assert (fd.id, fd.severity, fd.ranks) == ("DD003", "error", [0, 1])
    roles = {(loc.role, loc.rank, loc.line) for loc in fd.locations}
    assert roles == {("write", 0, 10), ("read", 1, 12)}
    assert CK in fd.message and fd.data["writers"] == [0] and fd.data["readers"] == [1]


def test_read_before_the_write_is_ordered(tmp_path):
    # rank 1 reads the old file, then both pass collective #1, then rank 0 overwrites it
    assert check(tmp_path, {0: [f("w", CK, {"0": 1}, 10)], 1: [f("r", CK, {}, 12)]}) == []


def test_removal_before_others_read_is_a_race(tmp_path):
    # rank 0 cleans up right after its own read; rank 1 reads in the same interval
    found = check(tmp_path, {0: [f("w", CK, {}, 10), f("r", CK, {"0": 1}, 12), f("rm", CK, {"0": 1}, 13)],
                             1: [f("r", CK, {"0": 1}, 12)]})
    assert [(x.severity, x.data["op"]) for x in found] == [("error", "rm")]


def test_incomplete_collective_does_not_order(tmp_path):
    # rank 1 issued barrier #2 with async_op=True and read before waiting: "done" says 1 completed
    race = {0: [f("w", CK, {"0": 1}, 10)], 1: [f("r", CK, {"0": 2}, 12, done={"0": 1})]}
    assert [x.severity for x in check(tmp_path, race)] == ["error"]
    waited = {0: [f("w", CK, {"0": 1}, 10)], 1: [f("r", CK, {"0": 2}, 12)]}
    assert check(tmp_path / "b", waited) == []


def test_rename_publishes_the_target(tmp_path):
    tmp = CK + ".tmp"
    publish = [f("w", tmp, {}, 10), f("mv", tmp, {}, 11, to=CK)]
    assert check(tmp_path, {0: publish, 1: [f("r", CK, {"0": 1}, 12)]}) == []
    found = check(tmp_path / "b", {0: publish, 1: [f("r", CK, {}, 12)]})
    assert len(found) == 1 and "renames" in found[0].message
    assert {(loc.role, loc.line) for loc in found[0].locations} == {("write", 11), ("read", 12)}


def test_shared_folders_logs_and_per_rank_files_are_silent(tmp_path):
    ranks = {r: [f("mkdir", "/ckpt", {}, 5),  # makedirs(exist_ok=True) everywhere
                 f("w", f"/ckpt/rank{r}.pt", {}, 6),  # per-rank names
                 f("w", "/ckpt/train.log", {}, 7, app=1)]  # a shared append-only log
             for r in range(4)}
    assert check(tmp_path, ranks) == []


def test_several_writers_is_a_warning(tmp_path):
    ranks = {r: [f("w", CK, {"0": 3}, 20)] for r in range(3)}
    found = check(tmp_path, ranks)
    assert [(x.severity, x.data["op"]) for x in found] == [("warning", "multi-write")]
    # one writer per epoch, a collective between them: not concurrent
    assert check(tmp_path / "b", {0: [f("w", CK, {"0": 1}, 20)], 1: [f("w", CK, {"0": 2}, 20)]}) == []


def test_only_groups_both_ranks_belong_to_order_them(tmp_path):
    pg = {"t": "pg", "op": "new", "g": "5", "ranks": [0, 1]}
    # ranks 0 and 1 are ordered by group 5; rank 2 is not a member, so nothing orders its read
    ranks = {0: [pg, f("w", CK, {"5": 0}, 10)], 1: [pg, f("r", CK, {"5": 1}, 12)],
             2: [f("r", CK, {}, 12)]}
    found = check(tmp_path, ranks, world=3)
    assert len(found) == 1 and found[0].data["readers"] == [2]


def test_directory_removal_covers_the_files_inside(tmp_path):
    race = {0: [f("rm", "/ckpt", {"0": 1}, 30)], 1: [f("r", CK, {"0": 1}, 12)]}
    assert [x.severity for x in check(tmp_path, race)] == ["error"]
    ordered = {0: [f("rm", "/ckpt", {"0": 2}, 30)], 1: [f("r", CK, {"0": 1}, 12)]}
    assert check(tmp_path / "b", ordered) == []


def test_node_local_paths_on_different_hosts_are_different_files(tmp_path):
    # every node's local rank 0 fills its own /tmp cache at the same time
    ranks = {r: [f("w", "/tmp/cache.bin", {"0": 1}, 50, loc=1)] for r in (0, 1)}
    assert check(tmp_path, ranks) != []  # one host: one file
    folder = write_traces(tmp_path / "b", ranks, hosts={0: "node-a", 1: "node-b"})
    assert run_check(MissingBarrier, folder) == []
    shared = {r: [f("w", "/nfs/cache.bin", {"0": 1}, 50)] for r in (0, 1)}  # a network filesystem
    folder = write_traces(tmp_path / "c", shared, hosts={0: "node-a", 1: "node-b"})
    assert [x.severity for x in run_check(MissingBarrier, folder)] == ["warning"]


def test_file_lock_protocol_is_not_flagged(tmp_path):
    lock = "/ckpt/model.pt.lock"
    ranks = {0: [f("w", lock, {}, 9), f("w", CK, {}, 10)], 1: [f("w", lock, {}, 9), f("r", CK, {}, 12)]}
    assert check(tmp_path, ranks) == []


def test_many_ranks_stay_fast_and_grouped(tmp_path):
    world = 256
    shared = {r: [f("w", "/data/raw.bin", {"0": 1}, 40), f("r", CK, {"0": 2}, 12)] for r in range(world)}
    shared[0].insert(0, f("w", CK, {"0": 1}, 10))
    folder = write_traces(tmp_path / "t", shared, world)
    t0 = time.perf_counter()
    found = run_check(MissingBarrier, folder)
    assert time.perf_counter() - t0 < 10
    assert [(x.severity, len(x.ranks)) for x in found] == [("warning", world)]
