"""Fault matrix, output faults: the trace folder read-only, on a full filesystem (full from the
start: the in-flight slot used to die of SIGBUS; filling up during the run), deleted during the
run, replaced by a file, or impossible to create. The training completes with the results of
the untraced run and its exit status, ddpdoctor prints one warning that says what happened and
what was kept, and the report says the same (never "no rank traced" or "killed while writing").

Filesystems are small tmpfs mounts (needs root; the cells that need one are skipped otherwise,
except the read-only folder, which a non-root user gets with chmod)."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid

import pytest
from faultkit import PY, ROOT, Live, base_env, ddpdoctor_lines, left_running, marker, run, torchrun, traced

STEPS = ("--steps", "12")


def _mount(path, size_kb: int, ro: bool = False) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    opts = f"size={size_kb}k" + (",ro" if ro else "")
    return subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)],
                          capture_output=True).returncode == 0


@pytest.fixture
def tmpfs(tmp_path):
    """mount(size_kb, free_kb=None, ro=False) -> a fresh tmpfs, filled up to leave free_kb."""
    mounted = []

    def mount(size_kb: int, free_kb: int | None = None, ro: bool = False):
        where = tmp_path / f"fs{len(mounted)}"
        if not _mount(where, size_kb, ro):
            pytest.skip("needs root to mount a small tmpfs")
        mounted.append(where)
        if free_kb is not None:
            st = os.statvfs(where)
            fill = st.f_bavail * st.f_frsize - free_kb * 1024
            with open(where / "filler", "wb") as f:
                f.write(b"\0" * max(0, fill))
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


@pytest.fixture(scope="module")
def untraced():
    """The untraced run every output cell is compared with (same program, same steps); it runs
    while the first cell's traced run does."""
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(1)
    future = pool.submit(run, torchrun("train.py", *STEPS))
    yield future
    pool.shutdown()


def _same_run(plain, tr, token) -> None:
    plain = plain.result()
    assert plain.returncode == 0, plain
    assert tr.returncode == plain.returncode, f"untraced {plain!r}\ntraced {tr!r}"
    assert tr.lines() == plain.lines(), f"untraced {plain!r}\ntraced {tr!r}"
    assert "Bus error" not in tr.stderr and "internal error" not in tr.stderr, tr
    assert left_running(token) == [], tr


def _warnings(tr) -> list[str]:
    return [x for x in ddpdoctor_lines(tr.stderr) if x.startswith("ddpdoctor: warning:")]


def test_read_only_folder(untraced, tmp_path, tmpfs):
    token = marker()
    if os.geteuid() == 0:
        out = tmpfs(64, ro=True)
    else:
        out = tmp_path / "ro"
        out.mkdir()
        out.chmod(0o555)
    tr = run(traced(torchrun("train.py", *STEPS, token), out))
    _same_run(untraced, tr, token)
    (warning,) = _warnings(tr)
    assert "cannot write into the trace folder" in warning and "runs untraced" in warning, tr
    assert "no rank traced" not in tr.stderr, tr


def test_full_filesystem_from_the_start(untraced, tmpfs):
    """No space even for the in-flight slot: the ranks used to die of SIGBUS (exit 135)."""
    token = marker()
    fs = tmpfs(128, free_kb=0)
    tr = run(traced(torchrun("train.py", *STEPS, token), fs / "trace"))
    _same_run(untraced, tr, token)
    (warning,) = _warnings(tr)
    assert "No space left on device" in warning, tr
    assert "ddpdoctor: no trace was kept" in tr.stderr, tr
    assert "no rank traced" not in tr.stderr, tr


def test_filesystem_fills_up_during_the_run(untraced, tmpfs):
    token = marker()
    fs = tmpfs(256, free_kb=40)  # the two in-flight slots (32 KB) and a page of trace each
    tr = run(traced(torchrun("train.py", *STEPS, token), fs / "trace", report=True))
    _same_run(untraced, tr, token)
    (warning,) = _warnings(tr)
    assert "No space left on device" in warning and "up to then kept" in warning, tr
    # the report runs on what was kept and says why the traces stop
    assert "the trace stops early" in tr.stdout and "No space left on device" in tr.stdout, tr
    assert "killed while writing" not in tr.stdout + tr.stderr, tr
    assert "no exit record" not in tr.stdout, tr


def test_folder_deleted_during_the_run(untraced, tmp_path):
    token = marker()
    out = tmp_path / "trace"
    go = tmp_path / f"go-{uuid.uuid4().hex[:6]}"
    live = Live(traced(torchrun("train.py", *STEPS, "--wait-after-init", str(go), token), out), base_env())
    assert live.wait_for("step 0"), live.finish()
    shutil.rmtree(out)
    go.touch()
    tr = live.finish()
    _same_run(untraced, tr, token)
    (warning,) = _warnings(tr)
    assert "removed or replaced during the run" in warning, tr
    assert "no rank traced" not in tr.stderr, tr


def test_folder_replaced_by_a_file_before_the_ranks_start(untraced, tmp_path):
    token = marker()
    out = tmp_path / "trace"
    go = tmp_path / f"go-{uuid.uuid4().hex[:6]}"
    live = Live(traced(torchrun("train.py", *STEPS, "--wait-before-init", str(go), token), out), base_env())
    deadline = 200
    while not out.is_dir() and deadline:
        deadline -= 1
        live.wait_for("never printed", timeout=0.05)
    shutil.rmtree(out)
    out.write_text("not a folder\n")
    go.touch()
    tr = live.finish()
    _same_run(untraced, tr, token)
    (warning,) = _warnings(tr)  # what happened, from the first rank to notice
    assert "could not create its trace" in warning, tr
    assert "removed or replaced" in tr.stderr, tr  # then what was kept


@pytest.mark.parametrize("where", ["under-a-file", "read-only-mount"])
def test_out_that_cannot_be_created_is_one_line_exit_2(tmp_path, tmpfs, where):
    if where == "under-a-file":
        (tmp_path / "f").write_text("x")
        out = tmp_path / "f" / "trace"
    else:
        out = tmpfs(64, ro=True) / "trace"
    flag = tmp_path / "ran"
    res = subprocess.run([PY, "-m", "ddpdoctor", "trace", "--out", str(out), "--", PY, "-c",
                          f"open({str(flag)!r}, 'w')"], capture_output=True, text=True, timeout=60,
                         cwd=str(ROOT))
    assert res.returncode == 2, res.stderr
    errors = [x for x in res.stderr.splitlines() if x.startswith("ddpdoctor: error:")]
    assert len(errors) == 1 and "cannot create the trace folder" in errors[0], res.stderr
    assert "Traceback" not in res.stderr and not flag.exists()
