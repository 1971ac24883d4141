"""Fault matrix, environment: PYTHONPATH already set, a script that patches torch.distributed
itself, threads issuing collectives on different groups, fork after init, persistent DataLoader
workers (one program exercises all five), ``python -I``, elastic restarts (``torchrun
--max-restarts``), and a DDP backward that raises and is caught (no false hang). Each runs
untraced and traced side by side: same results, same exit status, nothing left running,
traces readable (and created without world write permission, even under umask 0)."""

from __future__ import annotations

import os
import stat

import pytest
from faultkit import (
    PROGRAMS,
    PY,
    base_env,
    free_port,
    left_running,
    marker,
    pair,
    report_json,
    torchrun,
    traced,
)

HELPER = "VALUE = 42\n"


@pytest.fixture(scope="module")
def combined(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("env")
    helper = tmp / "userpath"
    helper.mkdir()
    (helper / "faultmatrix_helper.py").write_text(HELPER)
    env = base_env(PYTHONPATH=str(helper))
    token = marker()
    out = tmp / "trace"
    args = ("--helper", "--self-patch", "--threads", "--fork", "--loader", token)
    old = os.umask(0)  # the most permissive umask: trace files must still not be world-writable
    try:
        plain, tr = pair(torchrun("train.py", *args),
                         traced(torchrun("train.py", *args), out, "--hang-timeout", "5"), env=env)
    finally:
        os.umask(old)
    return plain, tr, out, token


def _lines(res, word: str) -> list[str]:
    return [x for x in res.lines() if f" {word} " in f" {x} "]


@pytest.mark.parametrize("cell,word", [("pythonpath-already-set", "helper"), ("script-patches-dist", "self-patched"),
                                       ("threads-on-two-groups", "threads"), ("fork-after-init", "forked"),
                                       ("persistent-dataloader-workers", "step")])
def test_environment_cell(combined, cell, word):
    plain, tr, _out, _token = combined
    want = _lines(plain, word)
    assert want, plain
    assert _lines(tr, word) == want, f"untraced {plain!r}\ntraced {tr!r}"


def test_combined_run_status_cleanup_and_permissions(combined):
    plain, tr, out, token = combined
    assert plain.returncode == 0, plain
    assert tr.returncode == 0 and tr.lines() == plain.lines(), tr
    assert "internal error" not in tr.stderr and "HANG" not in tr.stderr, tr
    assert left_running(token) == [], tr
    doc = report_json(out)
    assert sorted(doc["run"]["ranks_found"]) == [0, 1]
    assert not [f for f in doc["findings"] if f["severity"] == "error"], doc["findings"]
    for p in [out, *out.iterdir()]:
        mode = p.stat().st_mode
        assert not mode & stat.S_IWOTH, (p, oct(mode))


def test_python_isolated_mode(tmp_path):
    """-I ignores PYTHONPATH: the run is untraced and says why (never a false "no process group")."""
    token = marker()
    script = str(PROGRAMS / "linger.py")
    out = tmp_path / "trace"
    plain, tr = pair([PY, "-I", script, str(free_port()), "quick", token],
                     [PY, "-m", "ddpdoctor", "trace", "--out", str(out), "--", PY, "-I", script,
                      str(free_port()), "quick", token])
    assert tr.returncode == plain.returncode == 0 and "R exit codes [0, 0]" in plain.stdout, tr
    assert tr.lines() == plain.lines(), f"untraced {plain!r}\ntraced {tr!r}"
    assert "ignores PYTHONPATH" in tr.stderr and "-I" in tr.stderr, tr
    assert left_running(token) == []


def test_torchrun_max_restarts(tmp_path):
    token = marker()
    out = tmp_path / "trace"
    args = ("--fail-first-attempt", token)
    extra = ("--max-restarts=1", "--monitor-interval=0.2")
    plain, tr = pair(torchrun("train.py", *args, extra=extra),
                     traced(torchrun("train.py", *args, extra=extra), out, "--hang-timeout", "5"))
    assert plain.returncode == 0, plain
    assert tr.returncode == 0 and tr.lines() == plain.lines(), f"untraced {plain!r}\ntraced {tr!r}"
    assert left_running(token) == []
    doc = report_json(out)
    assert doc["run"]["attempt"] == 1 and sorted(doc["run"]["ranks_found"]) == [0, 1], doc["run"]


def test_caught_ddp_backward_error_is_no_hang(tmp_path):
    """The backward's in-flight entry used to outlive the error: a false SLOW COLLECTIVE on the
    backward (and with --on-hang kill a healthy job ended with 124). The program goes on for
    longer than the hang timeout after the error; a slow DDP construction on this loaded
    machine may be reported, but never the backward."""
    token = marker()
    out = tmp_path / "trace"
    args = ("--bwd-error", token)
    plain, tr = pair(torchrun("train.py", *args),
                     traced(torchrun("train.py", *args), out, "--hang-timeout", "5"))
    assert plain.returncode == 0 and "caught bad gradient" in plain.stdout, plain
    assert tr.returncode == 0 and tr.lines() == plain.lines(), f"untraced {plain!r}\ntraced {tr!r}"
    said = tr.stderr.replace(str(tmp_path), "")  # the folder's name holds the test's
    assert "DDP backward" not in said and "ddp_backward" not in said, tr
    assert left_running(token) == []
    doc = report_json(out)
    assert not [f for f in doc["findings"] if f["category"] == "hang" and "backward" in str(f).lower()], doc


def test_store_host_gone_after_destroy(tmp_path):
    """After destroy_process_group the store's host (rank 0) leaves while rank 1 lives on: the
    watchdog must not poll the vanished store (C++ printed "TCPStore recvValue failed")."""
    token = marker()
    out = tmp_path / "trace"
    script = str(PROGRAMS / "linger.py")
    plain, tr = pair([PY, script, str(free_port()), token],
                     traced([PY, script, str(free_port()), token], out, "--hang-timeout", "1"))
    assert plain.returncode == 0 and "lingered" in plain.stdout, plain
    assert tr.returncode == 0 and tr.lines() == plain.lines(), f"untraced {plain!r}\ntraced {tr!r}"
    for word in ("TCPStore", "recvValue", "Connection reset", "Broken pipe"):
        assert (word in tr.stderr) == (word in plain.stderr), (word, tr)
    assert left_running(token) == []
    report_json(out)
