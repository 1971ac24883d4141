"""Compact per-rank summaries (ddpdoctor/analysis/compact.py) and the block comparison that shares
one rank's block with the ranks of equal digests (align._block_events): the checks must see exactly
what the uncompacted summaries held."""

from __future__ import annotations

from collections import deque

from support.traces import coll, run_checks, write_traces

from ddpdoctor.analysis import align, load
from ddpdoctor.analysis.compact import Blocks, LineTail, Sharing, pack
from ddpdoctor.analysis.run import load_run


def test_blocks_and_line_tail_read_like_what_they_replace():
    raw = [[1, 2, 30], [4, 5, 600], [2**32 - 1, 0, 2**40]]
    b = Blocks(raw)
    assert len(b) == 3 and b[0] == (1, 2, 30) and b[-1][2] == 2**40 and b == raw and list(b[1:]) == [(4, 5, 600), (2**32 - 1, 0, 2**40)]
    assert [tuple(x) for x in raw] == list(b)
    events = deque([{"t": "c", "g": "0", "s": 1, "op": "all_reduce", "x": ["float32[4]"], "pending": 1},
                    {"t": "p", "ch": "0>1", "s": 2, "nobj": 3, "d": 1.5}], maxlen=4)
    t = LineTail(events)
    assert len(t) == 2 and t[-1] == events[-1] and list(t) == list(events) and t == events and bool(t)
    assert t[-1] is not t[-1]  # decoded on each access: a caller's change never reaches the summary
    assert not LineTail([])


def test_loaded_run_equals_the_ranks_read_one_by_one(tmp_path):
    """load_run packs and shares every rank's summary; each must still equal load.read_rank's."""
    ranks = {r: [coll(s, op="broadcast" if s % 7 == 0 else "all_reduce", d=100 + r * s) for s in range(1, 700)]
             for r in range(4)}
    ranks[3].append(coll(700, op="barrier", site=("other.py", 9)))
    write_traces(tmp_path, ranks)
    run = load_run([str(tmp_path)])
    for r, rt in run.ranks.items():
        direct = load.read_rank(rt.path)
        assert isinstance(rt.tail, LineTail) and isinstance(rt.groups["0"].blocks, Blocks)
        assert rt == direct, r
        assert list(rt.tail) == list(direct.tail) and rt.header == direct.header
    assert run.ranks[0].ddp_steps is run.ranks[1].ddp_steps and run.ranks[0].errors is run.ranks[3].errors
    assert run.ranks[0].waits != run.ranks[1].waits  # per-rank durations stay per rank


def test_sharing_keeps_values_equal_and_bounded():
    sh = Sharing(limit=3)
    a, b = {"x": [1, 2]}, {"x": [1, 2]}
    assert sh.share(a) is a and sh.share(b) is a
    t = sh.share([True])
    assert sh.share([1]) is not t and sh.share([True]) is t  # repr keys tell True from 1
    c = {"y": 3}
    assert sh.share(c) is c and sh.share({"y": 3}) is not c  # the table is full: nothing new kept
    rt = pack(load.RankTrace(path="p", tail=deque([{"t": "c", "s": 1}])))
    assert pack(rt) is rt and rt.tail[0] == {"t": "c", "s": 1}


def test_equal_blocks_are_read_once_and_each_rank_still_gets_its_own_events(tmp_path):
    """16 ranks with the same calls, one rank calling a barrier at #300: the block where they differ
    is read from one file per distinct digest; the events compared are each rank's own."""
    ranks = {r: [coll(s, d=1000 + r) for s in range(1, 400)] for r in range(16)}
    ranks[5][299] = coll(300, op="barrier", site=("ckpt.py", 58))
    write_traces(tmp_path, ranks)
    run = load_run([str(tmp_path)])
    evs = align._block_events(run, list(range(16)), "0", 1)
    assert evs[0].offsets is not None and evs[1].offsets is None and evs[1].ops is evs[0].ops
    assert evs[5].offsets is not None and evs[5].ops is not evs[0].ops
    assert evs[7][3]["d"] == 1007 and evs[7][3]["s"] == 260
    p = align.first_divergence(run, "0")
    assert p.seq == 300 and p.events[5]["op"] == "barrier" and p.events[9]["op"] == "all_reduce"
    assert p.events[9]["d"] == 1009 and p.events[12]["site"] != p.events[11]["site"]  # own ids
    (f,) = [f for f in run_checks(tmp_path) if f.id == "DD001"]
    assert f.ranks == [5]


def test_a_rank_that_stops_at_a_block_boundary_is_missing_its_next_call(tmp_path):
    """Rank 1 issues exactly one block (256 calls), rank 0 goes on: the first call rank 1 did not
    make is #257 (the block comparison once took rank 1's first call for its #257 and said #258)."""
    write_traces(tmp_path, {0: [coll(s) for s in range(1, 301)], 1: [coll(s) for s in range(1, 257)]})
    p = align.first_divergence(load_run([str(tmp_path)]), "0")
    assert p.seq == 257 and p.events[1] is None and p.events[0]["s"] == 257


def test_absurdly_nested_record_is_read_without_a_traceback(tmp_path):
    """A hostile trace with a deeply nested field: sharing and packing give up on it, never raise."""
    deep: list = []
    for _ in range(900):
        deep = [deep]
    ranks = {r: [coll(s) for s in range(1, 20)] for r in range(2)}
    ranks[1].append(coll(20, x=deep))
    write_traces(tmp_path, ranks)
    run = load_run([str(tmp_path)])
    assert run.ranks[0].events == 19 and run.ranks[1].events == 20
    assert run.ranks[1].tail[-1]["s"] == 20 and isinstance(run_checks(tmp_path), list)
