"""sync-overhead (DD010): per-step barriers and straggler ranks, with thresholds that keep short
and balanced runs silent.

Unit tests on hand-written traces (the bad/good programs run end to end in tests/e2e)."""

from __future__ import annotations

import pytest
from support.traces import coll, ddp_record, run_checks, write_run

BAR = ("train.py", 34, "dist.barrier()", [["train.py", 31, "for x in loader:", "for"]])
STEP = ("train.py", 36, "model(x)", [["train.py", 31, "for x in loader:", "for"]])
MS = 1000


def loop(steps: int, barrier_us=None, step_us=2 * MS, barrier_every: int = 1, gap_us: int = 0) -> list[dict]:
    """A DDP training loop: [barrier] forward backward per step, ``d`` in µs per call.
    ``barrier_us``/``step_us`` may be callables of the step index."""
    out = [coll(1, "ddp_init", ("train.py", 20), d=3_000_000), ddp_record()]
    s, ts = 2, 10_000
    for i in range(steps):
        if barrier_us is not None and i % barrier_every == 0:
            d = barrier_us(i) if callable(barrier_us) else barrier_us
            out.append(coll(s, "barrier", BAR, d=d, ts=ts))
            s, ts = s + 1, ts + d + 100
        out.append({"t": "e", "op": "ddp_forward", "g": "0", "s": 0, "d": 50, "site": STEP, "grad": 1,
                    "ts": ts})
        d = step_us(i) if callable(step_us) else step_us
        out.append(coll(s, "ddp_backward", STEP, d=d, ts=ts + 100))
        s, ts = s + 1, ts + d + 200 + gap_us
    return out


def test_barrier_before_every_ddp_step_with_its_cost(tmp_path):
    # rank 1 arrives 20 ms late at each of 60 barriers: rank 0 waits 1.2 s, rank 1 0.06 s
    ranks = {0: loop(60, barrier_us=21 * MS, gap_us=20 * MS), 1: loop(60, barrier_us=MS, gap_us=20 * MS)}
    found = [f for f in run_checks(write_run(tmp_path, ranks), "DD010") if f.data["kind"] == "barrier"]
    assert len(found) == 1
    f = found[0]
    assert f.severity == "info" and f.ranks == [0, 1] and f.data["calls"] == 60
    assert "once per step" in f.message and "right before a DDP forward/backward" in f.message
    assert "0.06 s to 1.26 s" in f.message and f.locations[0].line == 34
    assert f.data["own_s"] == pytest.approx(0.06) and f.data["max_s"] == pytest.approx(1.26)


def test_barriers_that_are_fine_stay_silent(tmp_path):
    cases = {
        "short run": {r: loop(10, barrier_us=200 * MS) for r in (0, 1)},
        "cheap barrier": {r: loop(200, barrier_us=300) for r in (0, 1)},
        "once per epoch": {r: loop(400, barrier_us=100 * MS, barrier_every=100) for r in (0, 1)},
    }
    for name, ranks in cases.items():
        found = run_checks(write_run(tmp_path / name.replace(" ", "_"), ranks), "DD010")
        assert [f.data["kind"] for f in found] == [], name


def test_barrier_next_to_a_manual_all_reduce_without_ddp(tmp_path):
    def manual(lag):
        out, s = [], 1
        for _ in range(30):
            out.append(coll(s, "barrier", BAR, d=lag))
            out.append(coll(s + 1, "all_reduce", ("train.py", 40, "dist.all_reduce(g)"), d=MS))
            s += 2
        return out

    found = run_checks(write_run(tmp_path, {0: manual(40 * MS), 1: manual(MS)}), "DD010")
    kinds = {f.data["kind"]: f for f in found}
    assert "barrier" in kinds and "all_reduce (30 calls at train.py:40" in kinds["barrier"].message


def test_straggler_is_named_with_the_time_others_lost(tmp_path):
    # rank 2 is 40 ms late at every step: ranks 0,1,3 wait 40 ms more each in the backward
    ranks = {r: loop(50, step_us=(2 if r == 2 else 42) * MS) for r in range(4)}
    found = [f for f in run_checks(write_run(tmp_path, ranks), "DD010") if f.data["kind"] == "straggler"]
    assert len(found) == 1
    f = found[0]
    assert f.ranks == [2] and f.severity == "warning" and f.data["others"] == 3
    assert f.data["lost_s"] == pytest.approx(2.0, rel=0.01)
    assert "rank 2 is consistently the last" in f.message.lower() and "ddp_backward" in f.message
    assert f.locations and f.locations[0].role == "waiting"


def test_balanced_one_off_and_short_runs_have_no_straggler(tmp_path):
    cases = {
        "balanced": {r: loop(100, step_us=(20 + r) * MS) for r in range(4)},
        # rank 0 writes a checkpoint once: the others wait 30 s in one backward, otherwise balanced
        "one-off": {r: loop(100, step_us=lambda i, r=r: 30_000 * MS if (r and i == 50) else 20 * MS)
                    for r in range(4)},
        "short": {r: loop(10, step_us=(2 if r == 1 else 500) * MS) for r in range(2)},
    }
    for name, ranks in cases.items():
        found = run_checks(write_run(tmp_path / name, ranks), "DD010")
        assert [f.data["kind"] for f in found if f.data["kind"] == "straggler"] == [], name


def test_most_ranks_slow_is_not_one_straggler(tmp_path):
    # half the ranks wait: nobody in particular holds the others back
    ranks = {r: loop(60, step_us=(2 if r < 2 else 42) * MS) for r in range(4)}
    assert [f for f in run_checks(write_run(tmp_path, ranks), "DD010") if f.data["kind"] == "straggler"] == []
