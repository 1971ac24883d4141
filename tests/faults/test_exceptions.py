"""Fault matrix, exceptions: every kind of call that raises (use before init, bad arguments,
invalid groups, a timeout, a dead peer, use after destroy) raises under ddpdoctor exactly as
without it: same type, same message, raised once (no ddpdoctor exception chained to it), same
exit status; nothing left running; the traces are readable afterwards.

One program (programs/exceptions.py, two ranks through multiprocessing) runs every case in
sequence, untraced and traced side by side; each case is one cell of the matrix."""

from __future__ import annotations

import pytest
from faultkit import (
    PROGRAMS,
    PY,
    free_port,
    left_running,
    marker,
    no_internal_error,
    pair,
    report_json,
    traced,
)

#: (case printed by the program, ranks that print it, marks)
CELLS = [
    ("before_init_all_reduce", (0, 1), ()),
    ("before_init_barrier", (0, 1), ()),
    ("before_init_get_rank", (0, 1), ()),
    ("bad_op", (0, 1), ()),
    ("unknown_keyword", (0, 1), ()),
    ("broadcast_src_str", (0, 1), ()),
    ("gather_dst_str", (0, 1), ()),
    ("send_dst_str", (0, 1), ()),
    ("broadcast_object_list_int", (0, 1), ()),
    ("scatter_object_list_int", (0, 1), ()),
    ("all_gather_wrong_list", (0, 1), ()),
    ("invalid_group_object", (0, 1), ()),
    ("destroyed_group", (0, 1), ()),
    ("timeout_all_reduce", (0,), ()),
    ("dead_peer_all_reduce", (0,), ()),
    ("dead_peer_broadcast", (0,), ()),
    ("after_destroy_all_reduce", (0,), ()),
    ("after_destroy_barrier", (0,), ()),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("exceptions") / "trace"
    token = marker()
    script = str(PROGRAMS / "exceptions.py")
    plain, tr = pair([PY, script, str(free_port()), token],
                     traced([PY, script, str(free_port()), token], out, "--hang-timeout", "0"))
    return plain, tr, out, token


def _case_lines(res, case: str) -> list[str]:
    return [x for x in res.lines() if x.startswith("E ") and x.split()[2] == case]


@pytest.mark.parametrize("case,ranks", [pytest.param(c, r, marks=m, id=c) for c, r, m in CELLS])
def test_exception_is_unchanged(runs, case, ranks):
    plain, tr, _out, _token = runs
    want = _case_lines(plain, case)
    assert [x.split()[1] for x in want] == [f"r{r}" for r in ranks], plain
    got = _case_lines(tr, case)
    assert got == want, f"untraced:\n{want}\ntraced:\n{got}\n{tr!r}"
    assert not any("from_ddpdoctor=True" in x for x in got)


def test_results_exit_status_and_cleanup(runs):
    plain, tr, out, token = runs
    assert plain.returncode == 0 and "R exit codes [0, 3]" in plain.stdout, plain
    assert tr.returncode == plain.returncode, tr
    assert [x for x in tr.lines() if x.startswith("R ")] == [x for x in plain.lines() if x.startswith("R ")]
    assert left_running(token) == []
    doc = report_json(out)
    assert sorted(doc["run"]["ranks_found"]) == [0, 1]


def test_no_internal_error_and_each_call_issued_once(runs):
    _plain, tr, out, _token = runs
    no_internal_error(tr)
    from conftest import read_records

    # rank 0's failing all_reduce after the timeout is one event, not two
    errs = [r for r in read_records(out, 0) if r.get("t") == "c" and r.get("err")]
    ops = [(r["op"], r["g"], r["s"]) for r in errs]
    assert len(ops) == len(set(ops)), errs
