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


#: si_code of a signal the kernel generated, e.g. the terminal's Ctrl-C (SIGINT to the whole
#: foreground process group): the command got it too and must not get it twice.
_SI_KERNEL = 0x80
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def prepare_out(out: str) -> str | None:
    """Create the trace folder. Raises LaunchError when it cannot be created (the user must
    fix the path); returns why it is not writable (the command then runs untraced), or None."""
    try:
        os.makedirs(out, mode=0o755, exist_ok=True)  # never world-writable, whatever the umask
    except OSError as exc:
        raise LaunchError(f"cannot create the trace folder {out}: {exc.strerror or exc}") from None
    probe = os.path.join(out, f".ddpdoctor-probe-{os.getpid()}")
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        os.unlink(probe)
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def run(command: list[str], out: str, hang_timeout: float | None, on_hang: str,
        poll: float = 0.2, faults: list | None = None) -> tuple[int, bool]:
    """Run the command; returns (exit status, whether ddpdoctor ended it after a hang).

    ``faults`` receives the ranks' trace-output failures (``outfault``): one warning is printed
    for the whole job when the first arrives. When the folder is not writable at all, the
    command runs untraced (one warning). Signals sent to this process (SIGINT, SIGTERM, SIGHUP,
    SIGQUIT) are passed to the command, as if it had been sent to it directly; the terminal's
    own (Ctrl-C, which reaches the whole process group) is not passed twice."""
    import sys

    from .trace import outfault

    not_writable = prepare_out(out)
    listener = None
    if not_writable is not None:
        print(f"ddpdoctor: warning: cannot write into the trace folder {out} ({not_writable}); "
              f"the command runs untraced", file=sys.stderr, flush=True)
        env = dict(os.environ)
        if faults is not None:
            faults.append({"stage": "folder", "why": not_writable, "out": out})
    else:
        env = child_env(out, hang_timeout, on_hang)
        try:
            listener = outfault.Listener(f"ddpdoctor-{env[settings.ENV_RUN_ID]}-{os.getpid()}")
            env[outfault.ENV_NOTIFY] = listener.name
        except OSError:
            listener = None  # the ranks then print their own warning
    received: list[int] = []
    handlers = {sig: signal.signal(sig, lambda s, f: received.append(s)) for sig in _FORWARDED}
    try:
        proc = subprocess.Popen(command, env=env)
    except OSError as exc:
        for sig, old in handlers.items():
            signal.signal(sig, old)
        if listener is not None:
            listener.close()
        raise LaunchError(f"cannot run {command[0]!r}: {exc.strerror or exc}") from None
    marker = os.path.join(out, KILL_MARKER)
    killed = False
    warned = False
    # Blocked from here on (after the child started, so it inherits no mask) and taken with
    # sigtimedwait, which says who sent each one.
    # Without sigtimedwait (macOS) the handlers pass every signal on.
    can_wait = hasattr(signal, "sigtimedwait")
    if can_wait:
        signal.pthread_sigmask(signal.SIG_BLOCK, _FORWARDED)
    try:
        while True:
            rc = proc.poll()
            if rc is not None:
                break
            while received:  # arrived before they were blocked
                proc.send_signal(received.pop(0))
            if not can_wait:
                try:
                    proc.wait(timeout=poll)
                except subprocess.TimeoutExpired:
                    pass
                info = None
            else:
                info = signal.sigtimedwait(_FORWARDED, poll)
            if info is not None and info.si_code != _SI_KERNEL:
                try:
                    proc.send_signal(info.si_signo)
                except OSError:
                    pass
            if listener is not None:
                new = listener.poll()
                if faults is not None:
                    faults.extend(new)
                if new and not warned:
                    warned = True
                    print(f"ddpdoctor: warning: {outfault.message(new[0])}", file=sys.stderr, flush=True)
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
        if can_wait:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _FORWARDED)
        for sig, old in handlers.items():
            signal.signal(sig, old)
        if listener is not None:
            new = listener.poll()
            if faults is not None:
                faults.extend(new)
            if new and not warned:
                print(f"ddpdoctor: warning: {outfault.message(new[0])}", file=sys.stderr, flush=True)
            listener.close()
    if os.path.exists(marker) and on_hang == "kill":
        killed = True
    return exit_status(rc), killed
