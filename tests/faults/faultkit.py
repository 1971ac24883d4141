"""The fault matrix's runner: a program run untraced and under ``ddpdoctor trace`` at the same
time, and what must be equal between the two runs.

Programs print their results as lines starting with ``R `` (results) and ``E `` (an exception
caught: type, message, its context/cause), one ``os.write`` each. Those lines are compared after
masking what differs between any two runs (ports, object addresses, pids).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
PROGRAMS = HERE / "programs"
PY = sys.executable
#: Bound of every run of the matrix (a cell that needs more is a hang, i.e. a failure).
RUN_TIMEOUT = 90

_MASKS = [(re.compile(r"0x[0-9a-fA-F]+"), "0x?"), (re.compile(r"\[?127\.0\.0\.1\]?:\d+"), "127.0.0.1:?"),
          (re.compile(r"\bpid[ =]\d+"), "pid ?"), (re.compile(r"\bport \d+"), "port ?")]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script: str, *args: str, nproc: int = 2, extra: tuple = ()) -> list[str]:
    return [PY, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", *extra,
            "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(PROGRAMS / script), *args]


def traced(command: list[str], out: Path | str, *options: str, report: bool = False) -> list[str]:
    """``ddpdoctor trace``; the report (on stdout) only when asked: stdout is compared."""
    rep = () if report else ("--no-report",)
    return [PY, "-m", "ddpdoctor", "trace", "--out", str(out), *rep, *options, "--", *command]


def base_env(**extra: str) -> dict:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("DDPDOCTOR_OUT", None)
    env.update(extra)
    return env


class Result:
    def __init__(self, cmd, returncode, stdout, stderr, seconds):
        self.cmd, self.returncode, self.stdout, self.stderr, self.seconds = cmd, returncode, stdout, stderr, seconds

    def lines(self, prefixes=("R ", "E ")) -> list[str]:
        """The program's result lines, masked, in a canonical order (ranks interleave)."""
        out = []
        for line in self.stdout.splitlines():
            if line.startswith(prefixes):
                for pat, rep in _MASKS:
                    line = pat.sub(rep, line)
                out.append(line)
        return sorted(out)

    def __repr__(self) -> str:
        return (f"<rc={self.returncode} {self.seconds:.1f}s cmd={' '.join(map(str, self.cmd))[-200:]}\n"
                f"stdout:\n{self.stdout[-3000:]}\nstderr:\n{self.stderr[-4000:]}>")


def start(cmd: list[str], env: dict | None = None, **kw) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env if env is not None else base_env(), cwd=str(ROOT),
                            start_new_session=True, errors="replace", **kw)


def finish(proc: subprocess.Popen, cmd, t0: float, timeout: float = RUN_TIMEOUT) -> Result:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        from ddpdoctor.launcher import kill_tree

        kill_tree(proc.pid, grace=1.0)
        out, err = proc.communicate()
        err += f"\n[faultkit: killed after {timeout} s]"
        return Result(cmd, "timeout", out, err, time.monotonic() - t0)
    return Result(cmd, proc.returncode, out, err, time.monotonic() - t0)


def run(cmd: list[str], env: dict | None = None, timeout: float = RUN_TIMEOUT) -> Result:
    t0 = time.monotonic()
    return finish(start(cmd, env), cmd, t0, timeout)


def pair(untraced_cmd: list[str], traced_cmd: list[str], env: dict | None = None,
         traced_env: dict | None = None, timeout: float = RUN_TIMEOUT) -> tuple[Result, Result]:
    """The untraced and the traced run, side by side (two cores: the pair takes one run's time)."""
    with ThreadPoolExecutor(2) as pool:
        a = pool.submit(run, untraced_cmd, env, timeout)
        b = pool.submit(run, traced_cmd, traced_env if traced_env is not None else env, timeout)
        return a.result(), b.result()


def marker() -> str:
    """A token put on a run's command line, to find what it left running."""
    return f"--cell={uuid.uuid4().hex[:10]}"


def left_running(token: str, grace: float = 5.0) -> list[str]:
    """Processes whose command line holds ``token`` (nothing of a finished run may survive)."""
    deadline = time.monotonic() + grace
    while True:
        found = []
        for p in psutil.process_iter(["pid", "cmdline"]):
            try:
                if token in " ".join(p.info["cmdline"] or []):
                    found.append(f"{p.pid}: {' '.join(p.info['cmdline'])[:200]}")
            except psutil.Error:
                continue
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def report_json(out: Path | str) -> dict:
    """The traces of a run are readable afterwards: ``ddpdoctor report --format json``."""
    res = subprocess.run([PY, "-m", "ddpdoctor", "report", str(out), "--format", "json"],
                         capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    assert res.returncode in (0, 1), res.stderr[-3000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    return json.loads(res.stdout)


def ddpdoctor_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("ddpdoctor:")]


def no_internal_error(res: Result) -> None:
    assert "internal error" not in res.stderr, res
    assert "Traceback" not in "\n".join(ddpdoctor_lines(res.stderr)), res


class Live:
    """A run whose output is watched while it runs (to act at a given point: send a signal,
    remove the trace folder)."""

    def __init__(self, cmd: list[str], env: dict | None = None) -> None:
        import threading

        self.cmd = cmd
        self.t0 = time.monotonic()
        self.proc = start(cmd, env)
        self.out: list[str] = []
        self.err: list[str] = []
        self._cond = threading.Condition()
        self._readers = [threading.Thread(target=self._read, args=(self.proc.stdout, self.out), daemon=True),
                         threading.Thread(target=self._read, args=(self.proc.stderr, self.err), daemon=True)]
        for t in self._readers:
            t.start()

    def _read(self, stream, sink: list[str]) -> None:
        for line in stream:
            with self._cond:
                sink.append(line)
                self._cond.notify_all()

    def wait_for(self, text: str, timeout: float = 60) -> bool:
        """Until a stdout line contains ``text`` (False on timeout or when the run ended)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not any(text in line for line in self.out):
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._readers[0].is_alive()):
                    return False
                self._cond.wait(min(left, 0.2))
        return True

    def pid_of(self, tag: str) -> int:
        """The pid a program printed as ``P <tag> pid N``."""
        for line in self.out:
            if line.startswith(f"P {tag} pid "):
                return int(line.split()[-1])
        raise LookupError(tag)

    def finish(self, timeout: float = RUN_TIMEOUT) -> Result:
        try:
            self.proc.wait(timeout=timeout)
            rc = self.proc.returncode
        except subprocess.TimeoutExpired:
            from ddpdoctor.launcher import kill_tree

            kill_tree(self.proc.pid, grace=1.0)
            rc = "timeout"
        for t in self._readers:
            t.join(timeout=10)
        return Result(self.cmd, rc, "".join(self.out), "".join(self.err), time.monotonic() - self.t0)
