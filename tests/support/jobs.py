"""Helpers of the end-to-end tests: run real multi-rank jobs under ``ddpdoctor trace``, bounded.

Every job run through :func:`trace` or :func:`run_bounded` is also checked for
"ddpdoctor: internal error" on its stderr: ddpdoctor must never break, even where a test only
looks at the findings."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
#: Every multi-process run is bounded by this many seconds unless a test says otherwise.
RUN_TIMEOUT = 120
#: What the recorder prints when ddpdoctor itself failed inside a rank (see Recorder.internal_error).
INTERNAL_ERROR = "ddpdoctor: internal error"


def assert_no_internal_error(res: subprocess.CompletedProcess) -> None:
    """ddpdoctor reported no failure of its own while the job ran."""
    for stream in (res.stderr, res.stdout):
        assert INTERNAL_ERROR not in (stream or ""), (stream or "")[-3000:]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script: str | os.PathLike, *args: str, nproc: int = 2) -> list[str]:
    """A torchrun command line on a free loopback port (tests run in parallel-safe ports)."""
    return [PY, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
            "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(script), *args]


def trace(command: list[str], out: str | os.PathLike, *options: str, timeout: float = RUN_TIMEOUT,
          env: dict | None = None) -> subprocess.CompletedProcess:
    """``ddpdoctor trace [options] --out OUT -- command``, output captured, bounded in time."""
    full_env = dict(os.environ)
    full_env.setdefault("EXAMPLE_PG_TIMEOUT", "20")
    full_env["PYTHONUNBUFFERED"] = "1"
    if env:
        full_env.update(env)
    cmd = [PY, "-m", "ddpdoctor", "trace", "--out", str(out), *options, "--", *command]
    return run_bounded(cmd, timeout=timeout, env=full_env)


def kill_tree(pid: int) -> None:
    """Kill a process and every descendant (torchrun workers live in their own sessions)."""
    from ddpdoctor.launcher import kill_tree as kill

    kill(pid, grace=1.0)


def run_bounded(cmd: list[str], timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """subprocess.run with output captured; on timeout the whole process tree is killed, so a
    hanging job never outlives its test."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=str(ROOT))
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err) from None
    res = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    assert_no_internal_error(res)
    return res


def report(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "ddpdoctor", "report", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, cwd=str(ROOT))


def findings_json(trace_dir, *extra: str) -> dict:
    import json

    res = report(trace_dir, "--format", "json", *extra)
    assert res.returncode in (0, 1), res.stderr
    return json.loads(res.stdout)


def read_records(trace_dir, rank: int) -> list[dict]:
    """All records of one rank's trace file."""
    import json

    files = sorted(Path(trace_dir).glob(f"rank{rank:05d}-*.jsonl"))
    assert files, f"no trace file for rank {rank} in {trace_dir}: {os.listdir(trace_dir)}"
    out = []
    with open(files[-1]) as f:
        for line in f:
            if line.endswith("\n"):
                out.append(json.loads(line))
    return out


def example_reports(tmp_path_factory, category: str, names=("bad", "good"), failing=("bad",),
                    pg_timeout: str | None = "10") -> dict[str, list]:
    """Run ``checks/<category>/<name>.py`` under ``ddpdoctor trace`` (two runs at a time; a name
    ``bad-x`` runs bad.py with the argument ``x``), assert which ones fail (exit status), and
    return each run's findings from ``ddpdoctor report --format json``."""
    from concurrent.futures import ThreadPoolExecutor

    folder = ROOT / "checks" / category

    def one(name):
        d = tmp_path_factory.mktemp(f"{category}-{name}") / "trace"
        script, *args = name.split("-")
        env = {"EXAMPLE_PG_TIMEOUT": pg_timeout} if pg_timeout else None
        res = trace(torchrun(folder / f"{script}.py", *args), d, "--no-report", "--hang-timeout", "0", env=env)
        return name, res, d

    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(one, names))
    out = {}
    for name, res, d in runs:
        assert (res.returncode != 0) == (name in failing), res.stdout + res.stderr
        out[name] = findings_json(d)["findings"]
    return out
