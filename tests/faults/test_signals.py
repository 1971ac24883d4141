"""Fault matrix, signals: SIGINT and SIGTERM sent to ``ddpdoctor trace`` during training end the
job as the same signal sent to torchrun does (same exit status, every process gone); SIGKILL of
one rank mid-collective ends the job as without ddpdoctor; SIGKILL of ddpdoctor itself leaves
the job undisturbed (it completes with the same results). Traces stay readable."""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest
from faultkit import Live, base_env, left_running, marker, report_json, torchrun, traced

LONG = ("--steps", "400", "--sleep", "0.05")


def _interrupt(cmd, sig, target: str):
    """Start, wait for the second step, send ``sig`` to the top process (target "top") or to
    rank 1 (target "rank1"), and collect the run."""
    live = Live(cmd, base_env(FAULT_PG_TIMEOUT="10"))
    assert live.wait_for("step 1", timeout=60), live.finish()
    pid = live.proc.pid if target == "top" else live.pid_of("rank1")
    os.kill(pid, sig)
    return live.finish(timeout=60)


def _twins(tmp_path, sig, target):
    token = marker()
    out = tmp_path / "trace"
    with ThreadPoolExecutor(2) as pool:
        a = pool.submit(_interrupt, torchrun("train.py", *LONG, token), sig, target)
        b = pool.submit(_interrupt, traced(torchrun("train.py", *LONG, token), out, "--hang-timeout", "0"),
                        sig, target)
        plain, tr = a.result(), b.result()
    return plain, tr, out, token


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_to_ddpdoctor_trace_is_passed_on(tmp_path, sig):
    plain, tr, out, token = _twins(tmp_path, sig, "top")
    assert plain.returncode != "timeout", plain
    assert tr.returncode == plain.returncode, f"untraced {plain!r}\ntraced {tr!r}"
    assert left_running(token, grace=10) == [], tr
    assert tr.seconds < plain.seconds + 15, (plain.seconds, tr.seconds)
    doc = report_json(out)
    assert sorted(doc["run"]["ranks_found"]) == [0, 1]


def test_sigkill_of_one_rank_mid_collective(tmp_path):
    plain, tr, out, token = _twins(tmp_path, signal.SIGKILL, "rank1")
    assert plain.returncode not in (0, "timeout"), plain
    assert tr.returncode == plain.returncode, f"untraced {plain!r}\ntraced {tr!r}"
    assert left_running(token, grace=10) == [], tr
    doc = report_json(out)
    assert any(f["category"] == "rank-failed" for f in doc["findings"]), doc["findings"]


def test_sigkill_of_ddpdoctor_leaves_the_job_undisturbed(tmp_path):
    token = marker()
    out = tmp_path / "trace"
    steps = ("--steps", "30", "--sleep", "0.05")
    with ThreadPoolExecutor(2) as pool:
        a = pool.submit(lambda: Live(torchrun("train.py", *steps, token), base_env()).finish())
        live = Live(traced(torchrun("train.py", *steps, token), out, "--hang-timeout", "0"), base_env())
        assert live.wait_for("step 1", timeout=60), live.finish()
        os.kill(live.proc.pid, signal.SIGKILL)
        tr = live.finish(timeout=60)  # stdout stays open until the job's last process ends
        plain = a.result()
    assert plain.returncode == 0, plain
    assert tr.returncode == -signal.SIGKILL
    assert tr.lines() == plain.lines(), f"untraced {plain!r}\ntraced {tr!r}"
    assert left_running(token, grace=20) == [], tr
    doc = report_json(out)
    assert sorted(doc["run"]["ranks_found"]) == [0, 1] and not doc["findings"], doc
