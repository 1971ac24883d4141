"""collective-mismatch when the backend completed the mismatched call on some ranks: gloo fills an
all_gather partially on one side and aborts the other, or aborts only at a later call. The first
mismatching call is the root cause, whichever call a rank died in."""

from __future__ import annotations

from support.traces import coll, run_checks, write_run

from ddpdoctor.analysis.checks.collective_mismatch import CollectiveMismatch
from ddpdoctor.analysis.checks.divergent_collectives import DivergentCollectives

SITE = ("train.py", 12, "dist.all_gather(out, x)")


def _gather(s: int, x: str) -> dict:
    return coll(s, "all_gather", site=SITE, x=[x], n=0, xo=[x, x])


def _inflight(s: int, x: str) -> dict:
    return {"t": "pending", "op": "all_gather", "g": "0", "s": s, "x": [x], "xo": [x, x],
            "site": SITE, "src": "inflight"}


CRASH = {"t": "exit", "how": "crash", "exc": "Fatal Python error: Aborted", "file": "train.py", "line": 12}


def test_rank_died_inside_the_call_the_other_completed(tmp_path):
    # rank 1 completed all_gather #1 (partially filled) and went on; rank 0 aborted inside it
    folder = write_run(tmp_path, {
        0: [coll(1, x=["float32[8]"], rop="SUM"), _inflight(2, "float32[4]")],
        1: [coll(1, x=["float32[8]"], rop="SUM"), _gather(2, "float32[5]"), coll(3, x=["float32[10]"], rop="SUM")],
    }, exits={0: None, 1: {"t": "exit", "how": "exception", "exc": "RuntimeError: Connection reset by peer"}})
    found = run_checks(folder, "DD002", "DD001")
    mism = [f for f in found if f.id == CollectiveMismatch.id]
    assert len(mism) == 1 and mism[0].data["seq"] == 2 and mism[0].data["op"] == "all_gather"
    assert "rank 0 ['float32[4]']" in mism[0].message and "rank 1 ['float32[5]']" in mism[0].message
    assert "rank 1 completed it" in mism[0].message and "rank 0 died inside it" in mism[0].message
    # the divergence that follows (rank 0 has no #3) is explained by the mismatch
    assert not [f for f in found if f.id == DivergentCollectives.id]


def test_first_mismatch_reported_when_a_rank_dies_in_a_later_call(tmp_path):
    # same element count, different shapes: every rank completes #1; rank 0 dies inside #3
    folder = write_run(tmp_path, {
        0: [_gather(1, "float32[2,3]"), coll(2, x=["float32[10]"], rop="SUM"),
            {"t": "pending", "op": "all_reduce", "g": "0", "s": 3, "x": ["float32[10]"], "rop": "SUM",
             "site": ("train.py", 18), "src": "inflight"}],
        1: [_gather(1, "float32[3,2]"), coll(2, x=["float32[10]"], rop="SUM"),
            coll(3, x=["float32[11]"], rop="SUM", site=("train.py", 18)), coll(4, "barrier", site=("train.py", 20))],
    }, exits={0: CRASH, 1: {"t": "exit", "how": "exception", "exc": "RuntimeError: Connection reset by peer"}})
    mism = run_checks(folder, "DD002")
    assert [f.data["seq"] for f in mism] == [1, 3]
    assert "float32[2,3]" in mism[0].message and "float32[3,2]" in mism[0].message
    assert "failed later" in mism[0].message
    assert "rank 0 died inside it" in mism[1].message


def test_rank_died_inside_a_matching_call_is_no_mismatch(tmp_path):
    # rank 0 died inside #2 for another reason; its call matches rank 1's
    folder = write_run(tmp_path, {
        0: [_gather(1, "float32[4]"), _inflight(2, "float32[4]")],
        1: [_gather(1, "float32[4]"), _gather(2, "float32[4]"), coll(3, x=["float32[10]"], rop="SUM")],
    }, exits={0: CRASH})
    assert run_checks(folder, "DD002") == []


def test_completed_mismatch_without_failure_says_nothing_about_a_crash(tmp_path):
    folder = write_run(tmp_path, {0: [_gather(1, "float32[2,3]")], 1: [_gather(1, "float32[3,2]")]})
    mism = run_checks(folder, "DD002")
    assert len(mism) == 1 and "root cause" not in mism[0].message
