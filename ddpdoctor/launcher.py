"""``ddpdoctor trace -- COMMAND``: run a command unchanged with every rank instrumented.

Injection is through the environment only (never argv): the bootstrap directory goes first on
PYTHONPATH and the settings into DDPDOCTOR_* variables, which every launcher (torchrun,
mp.spawn, plain subprocesses) passes on to the processes it starts.
"""

from __future__ import annotations

import datetime as _dt
import os
import signal
import subprocess
import uuid

from .errors import EXIT_HANG, LaunchError
from .rank import settings
from .trace.files import KILL_MARKER

__all__ = ["EXIT_HANG", "LaunchError", "KILL_MARKER"]

BOOTSTRAP_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank", "_bootstrap")
PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def default_out_dir(base: str = "ddpdoctor-traces") -> str:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = os.path.join(base, stamp)
    n = 1
    while os.path.exists(path):
        n += 1
        path = os.path.join(base, f"{stamp}-{n}")
    return path


def child_env(out: str, hang_timeout: float | None, on_hang: str, run_id: str | None = None,
              base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    paths = [BOOTSTRAP_DIR] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env[settings.ENV_OUT] = os.path.abspath(out)
    env[settings.ENV_RUN_ID] = run_id or uuid.uuid4().hex[:12]
    env[settings.ENV_HOME] = PACKAGE_PARENT
    if hang_timeout is not None:
        env[settings.ENV_HANG_TIMEOUT] = str(hang_timeout)
    env[settings.ENV_ON_HANG] = on_hang
    return env


def exit_status(returncode: int) -> int:
    """Shell convention: a command killed by signal N exits 128+N."""
    return 128 - returncode if returncode < 0 else returncode


def kill_tree(pid: int, grace: float = 3.0) -> None:
    """SIGTERM then SIGKILL every descendant of pid (torchrun workers live in their own sessions,
    so a process-group signal would miss them) and pid itself."""
    import psutil

    try:
        parent = psutil.Process(pid)
        procs = parent.children(recursive=True) + [parent]
    except psutil.Error:
        return
    for p in procs:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=grace)


def run(command: list[str], out: str, hang_timeout: float | None, on_hang: str,
        poll: float = 0.2) -> tuple[int, bool]:
    """Run the command; returns (exit status, whether ddpdoctor ended it after a hang)."""
    os.makedirs(out, exist_ok=True)
    env = child_env(out, hang_timeout, on_hang)
    try:
        proc = subprocess.Popen(command, env=env)
    except OSError as exc:
        raise LaunchError(f"cannot run {command[0]!r}: {exc.strerror or exc}") from None
    marker = os.path.join(out, KILL_MARKER)
    killed = False
    # The terminal's Ctrl-C reaches the child too (same process group); we just keep waiting.
    old_int = signal.signal(signal.SIGINT, lambda *_: None)
    old_term = signal.signal(signal.SIGTERM, lambda s, f: proc.send_signal(s))
    try:
        while True:
            try:
                rc = proc.wait(timeout=poll)
                break
            except subprocess.TimeoutExpired:
                pass
            if on_hang == "kill" and not killed and os.path.exists(marker):
                killed = True
                # The ranks end themselves (exit 124) once the diagnosis is written, and the
                # launcher under us (torchrun) then exits; only what is left is killed.
                try:
                    rc = proc.wait(timeout=8)
                    break
                except subprocess.TimeoutExpired:
                    kill_tree(proc.pid)
    finally:
        signal.signal(signal.SIGINT, old_int)
        signal.signal(signal.SIGTERM, old_term)
    if os.path.exists(marker) and on_hang == "kill":
        killed = True
    return exit_status(rc), killed
