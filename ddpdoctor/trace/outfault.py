"""When the trace output fails: the program must run on exactly as it would untraced.

Opening the trace folder or a file in it, or writing a record, can fail for reasons that have
nothing to do with the program: a read-only or full filesystem, a folder deleted or replaced by
a file during the run, a quota. Any trace writer reports such a failure here (``failed``); from
then on this process records nothing (every wrapper steps aside), its watchdog stops, and one
warning says what happened and what was kept:

- under ``ddpdoctor trace`` the rank sends one datagram to the launcher (an abstract Unix socket
  named in ``DDPDOCTOR_NOTIFY``, so no file is needed on the failing disk), which prints a single
  warning for the whole job and passes the facts to the report;
- otherwise (another node, ``ddpdoctor.check`` without the launcher) the rank prints it.

The rank also leaves a ``stopped`` record in its in-flight slot, whose space was reserved when it
was created, so the report can say the trace stops because of the disk, not because the rank was
killed; the exit record, written there too, still tells how the rank ended.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import sys
import threading

ENV_NOTIFY = "DDPDOCTOR_NOTIFY"
#: errno values that mean the output is unusable (anything else is an internal error).
OUTPUT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EBADF,
                           errno.EFBIG, errno.ENOENT, errno.EACCES, errno.EPERM, errno.ENOTDIR,
                           errno.EEXIST, errno.EISDIR, errno.ESTALE})
_lock = threading.Lock()


def is_output_error(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in OUTPUT_ERRNOS


def describe(exc: BaseException) -> str:
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    return f"{type(exc).__name__}: {exc}"


def failed(rec, exc: BaseException, stage: str) -> None:
    """The trace output of this process failed (``stage``: "create" or "write"): stop recording,
    keep the program untouched, say so once."""
    with _lock:
        if getattr(rec, "output_fault", None) is not None:
            return
        kept = "nothing" if stage == "create" else "its trace up to then"
        info = {"t": "stopped", "why": describe(exc), "errno": getattr(exc, "errno", None),
                "stage": stage, "rank": rec.rank, "pid": os.getpid(), "out": rec.settings.out,
                "events": rec.events, "ts": rec.now_us(), "kept": kept}
        rec.output_fault = info
        rec.enabled = False  # every wrapper now calls straight through
        w, rec.writer = rec.writer, None
    if w is not None:
        try:
            # Not closed: another thread may be about to write to its fd, which a reused
            # descriptor number would turn into a write into one of the program's files.
            w.closed = True
        except AttributeError:
            pass
    wd = getattr(rec, "watchdog", None)
    if wd is not None:
        try:
            wd._stop_evt.set()  # not stop(): this may run on the watchdog's own thread
        except AttributeError:
            pass
    _mark_slot(rec, info)
    if not _notify(info):
        print(f"ddpdoctor: warning: {message(info)}", file=sys.stderr, flush=True)


def message(info: dict, ranks: str | None = None) -> str:
    who = f"rank {info.get('rank')}" if ranks is None else f"rank(s) {ranks}"
    verb = "could not create its trace" if info.get("stage") == "create" else "could not write its trace"
    return (f"{who} {verb} in {info.get('out')} ({info.get('why')}); the program runs on untraced "
            f"from there ({info.get('kept')} kept)")


def keep_exit(rec, line: str) -> None:
    """After a fault, the exit record still goes to the (reserved) in-flight slot."""
    info = rec.output_fault
    if info is None:
        return
    try:
        ex = json.loads(line)
    except ValueError:
        return
    _mark_slot(rec, dict(info, exit=ex))


def _mark_slot(rec, info: dict) -> None:
    slot = getattr(rec, "slot", None)
    if slot is None:
        return
    try:
        slot.set(json.dumps(info, default=str, separators=(",", ":")))
    except Exception:
        pass


def _notify(info: dict) -> bool:
    addr = os.environ.get(ENV_NOTIFY)
    if not addr:
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.setblocking(False)
            s.sendto(json.dumps(info, default=str).encode()[:60000], "\0" + addr)
        return True
    except OSError:
        return False


class Listener:
    """The launcher's end: collects the ranks' output-fault datagrams."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.faults: list[dict] = []
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + name)
        self.sock.setblocking(False)

    def poll(self) -> list[dict]:
        """New faults since the last poll."""
        new = []
        while True:
            try:
                data = self.sock.recv(65536)
            except OSError:
                break
            try:
                info = json.loads(data)
            except ValueError:
                continue
            if isinstance(info, dict):
                new.append(info)
        self.faults.extend(new)
        return new

    def close(self) -> None:
        self.sock.close()


def open_private(path: str, append: bool = False):
    """A text file ddpdoctor writes beside the traces: created 0644 minus the umask, never
    world-writable (it may hold paths, argv and source lines)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | (os.O_APPEND if append else os.O_TRUNC)
    # open() with an opener (not os.fdopen) so that the file's .name is its path
    return open(path, "a" if append else "w", opener=lambda p, _f: os.open(p, flags, 0o644))  # noqa: SIM115
