"""p2p-mismatch (DD011): sends and receives that do not pair up.

Unit tests on hand-written traces (the bad/good programs run end to end in tests/e2e)."""

from __future__ import annotations

from support.traces import GLOO_TIMEOUT, coll, raised, run_checks, write_run

SEND = ("pipe.py", 10, "dist.send(t, dst=1)")
RECV = ("pipe.py", 14, "dist.recv(buf, src=0)")


def p(op: str, ch: str, s: int, x=("float32[4]",), site=None, **extra) -> dict:
    site = site or (SEND if "send" in op else RECV)
    rec = {"t": "p", "op": op, "g": "0", "ch": ch, "s": s, "d": 10, "site": site, **extra}
    if x is not None:
        rec.update(x=list(x), n=4)
    return rec


def test_send_never_received(tmp_path):
    ranks = {0: [p("send", "0>1", 1), p("send", "0>1", 2), p("send", "0>1", 3, err=GLOO_TIMEOUT)],
             1: [p("recv", "0>1", 1), p("recv", "0>1", 2), coll(1, "barrier", err=GLOO_TIMEOUT)]}
    folder = write_run(tmp_path, ranks, exits={0: raised(GLOO_TIMEOUT, line=10), 1: raised(GLOO_TIMEOUT)})
    found = run_checks(folder, "DD011", "DD001", "DD008")
    assert [f.id for f in found] == ["DD011"]  # rank 0 "made no call #1": explained here, not by DD001
    f = found[0]
    assert f.ranks == [0, 1] and f.data["sent"] == 3 and f.data["received"] == 2 and f.data["index"] == 3
    assert "send #3 at pipe.py:10" in f.message and "never received" in f.message
    assert "Timed out" in f.message and f.locations[0].line == 10


def test_receive_waits_for_a_message_never_sent(tmp_path):
    ranks = {0: [p("isend", "0>1", 1)], 1: [p("irecv", "0>1", 1), p("recv", "0>1", 2)]}
    found = run_checks(write_run(tmp_path, ranks), "DD011")
    assert len(found) == 1 and "recv #2 at pipe.py:14 main() waits for a message that never comes" in found[0].message


def test_shape_mismatch_names_the_first_differing_message(tmp_path):
    ranks = {0: [p("send", "0>1", 1), p("send", "0>1", 2, x=["float32[8]"])],
             1: [p("recv", "0>1", 1), p("recv", "0>1", 2)]}
    found = run_checks(write_run(tmp_path, ranks), "DD011")
    assert len(found) == 1 and found[0].data["kind"] == "meta" and found[0].data["index"] == 2
    assert "sends float32[8]" in found[0].message and "receives into float32[4]" in found[0].message


def test_matched_channels_are_silent(tmp_path):
    ring = {r: [p("isend", f"{r}>{(r + 1) % 4}", 1, batch=1),
                p("irecv", f"{(r - 1) % 4}>{r}", 1, batch=1),
                p("send_object_list", f"{r}>{(r + 1) % 4}", 2, x=None, nobj=2),
                p("recv_object_list", f"{(r - 1) % 4}>{r}", 2, x=None, nobj=2)] for r in range(4)}
    assert run_checks(write_run(tmp_path, ring), "DD011") == []


def test_receive_from_any_source_is_compared_in_total(tmp_path):
    ranks = {0: [p("recv", "?>0", 1), p("recv", "?>0", 2)], 1: [p("send", "1>0", 1)], 2: [p("send", "2>0", 1)]}
    assert run_checks(write_run(tmp_path / "a", ranks), "DD011") == []
    ranks[0].append(p("recv", "?>0", 3))
    found = run_checks(write_run(tmp_path / "b", ranks), "DD011")
    assert len(found) == 1 and found[0].ranks == [0] and "3 message(s) from any source" in found[0].message


def test_a_receiver_that_died_is_left_to_rank_failed(tmp_path):
    ranks = {0: [p("send", "0>1", 1), p("send", "0>1", 2, err=GLOO_TIMEOUT)], 1: [p("recv", "0>1", 1)]}
    folder = write_run(tmp_path, ranks, exits={0: raised(GLOO_TIMEOUT), 1: raised("ValueError: bad input")})
    assert [f.id for f in run_checks(folder, "DD011", "DD008")] == ["DD008"]
