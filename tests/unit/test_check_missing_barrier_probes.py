"""missing-barrier (DD003) with existence checks and listings as reads (issue 13, item 4):
``os.path.exists``/``Path.is_file``/``os.stat`` (probe ``stat``), ``os.listdir``/``os.scandir``
(``listdir``) and ``glob.glob`` (``glob``) on hand-written traces."""

from __future__ import annotations

from support.traces import run_check, write_run, write_traces

from ddpdoctor.analysis.checks.missing_barrier import MissingBarrier

CK = "/ckpt/model.pt"


def f(op: str, path: str, pos: dict, line: int, **extra) -> dict:
    return {"t": "file", "op": op, "path": path, "pos": pos, "site": ("train.py", line), **extra}


def check(tmp_path, ranks):
    return run_check(MissingBarrier, write_traces(tmp_path / "t", ranks))


def test_existence_check_concurrent_with_the_write_is_a_race(tmp_path):
    found = check(tmp_path, {0: [f("w", CK, {"0": 1}, 10)],
                             1: [f("r", CK, {"0": 1}, 14, probe="stat", miss=1)]})
    assert len(found) == 1 and found[0].severity == "error"
    assert {(loc.role, loc.rank, loc.line) for loc in found[0].locations} == {("write", 0, 10), ("read", 1, 14)}
    assert "checks whether it exists (it did not yet)" in found[0].message


def test_existence_check_ordered_by_a_collective_is_silent(tmp_path):
    # resume logic: every rank checks at start, rank 0 saves after collective #1
    assert check(tmp_path, {0: [f("r", CK, {}, 5, probe="stat", miss=1), f("w", CK, {"0": 1}, 10)],
                            1: [f("r", CK, {}, 5, probe="stat", miss=1)]}) == []
    # save, barrier, then every rank checks
    assert check(tmp_path / "b", {0: [f("w", CK, {}, 10)], 1: [f("r", CK, {"0": 1}, 14, probe="stat")]}) == []


def test_listing_and_glob_are_reads_of_the_files_they_can_see(tmp_path):
    listing = check(tmp_path, {0: [f("w", CK, {"0": 1}, 10)],
                               1: [f("r", "/ckpt", {"0": 1}, 14, probe="listdir")]})
    assert len(listing) == 1 and "lists the directory holding it" in listing[0].message
    globbed = check(tmp_path / "g", {0: [f("w", CK, {"0": 1}, 10)],
                                     1: [f("r", "/ckpt/*.pt", {"0": 1}, 14, probe="glob")]})
    assert len(globbed) == 1 and "globs a pattern" in globbed[0].message
    # a pattern or directory that cannot see the file is no read of it
    assert check(tmp_path / "n", {0: [f("w", CK, {"0": 1}, 10)],
                                  1: [f("r", "/ckpt/*.json", {"0": 1}, 14, probe="glob"),
                                      f("r", "/other", {"0": 1}, 15, probe="listdir")]}) == []


def test_poll_then_load_reports_the_load_with_the_check(tmp_path):
    found = check(tmp_path, {0: [f("w", CK, {"0": 1}, 10)],
                             1: [f("r", CK, {"0": 1}, 14, probe="stat", miss=1), f("r", CK, {"0": 1}, 16)]})
    assert len(found) == 1
    roles = {(loc.role, loc.line) for loc in found[0].locations}
    assert roles == {("write", 10), ("read", 16), ("check", 14)}
    assert "no synchronisation" in found[0].message


def test_rank_that_failed_after_the_check_is_named(tmp_path):
    folder = write_run(tmp_path, {0: [f("w", CK, {"0": 1}, 10)],
                                  1: [f("r", CK, {"0": 1}, 14, probe="stat", miss=1)]},
                       exits={1: {"t": "exit", "how": "exception", "exc": "FileNotFoundError: no checkpoint",
                                  "file": "train.py", "line": 15, "ts": 10 ** 8}})
    found = run_check(MissingBarrier, folder)
    assert len(found) == 1 and "then failed (FileNotFoundError: no checkpoint at line 15)" in found[0].message
    assert "root cause" in found[0].message
