"""The on-disk trace format: one JSON Lines file per rank process (see docs/trace-format.md).

Writing goes straight to the file descriptor with ``os.write``: every record reaches the OS as
it is written, so a rank killed with SIGKILL leaves a readable file up to its last record, at
the cost of one syscall a record (about 1 µs here; ``fsync`` is only done on hang and exit).
"""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
import threading

#: Bumped whenever a record's meaning changes; readers accept every version up to their own.
SCHEMA_VERSION = 1
SUFFIX = ".jsonl"
PREFIX = "rank"
#: Written into the trace folder by a rank when the job is to be ended after a hang (--on-hang
#: kill); the launcher watches for it.
KILL_MARKER = "HANG_KILL"
#: faulthandler's stack dumps (SIGTERM, SIGUSR2, a fatal error) beside a rank's trace file.
STACKS_SUFFIX = ".stacks.txt"


def stacks_path(trace_path: str) -> str:
    """The stack-dump file beside a trace file."""
    return trace_path[: -len(SUFFIX)] + STACKS_SUFFIX


def trace_file_name(rank: int, host: str, pid: int, attempt: int) -> str:
    """Name that never collides across ranks, hosts, pids and torchrun restart attempts."""
    safe_host = "".join(c if c.isalnum() or c in "-_." else "_" for c in host)[:64]
    return f"{PREFIX}{rank:05d}-{safe_host}-{pid}-a{attempt}{SUFFIX}"


def dumps(record: dict) -> str:
    return json.dumps(record, separators=(",", ":"), default=str)


class TraceWriter:
    """Appends records to one rank's trace file; safe to call from several threads."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        self.fd = self._fd  # for the recorder's inlined hot path
        self._lock = threading.Lock()
        self.closed = False

    def write_line(self, line: str) -> None:
        """Write one already-encoded record (without its newline)."""
        if self.closed:
            return
        # O_APPEND writes of one small buffer are not interleaved with other threads' writes.
        os.write(self._fd, (line + "\n").encode("utf-8", "backslashreplace"))

    def write(self, record: dict) -> None:
        self.write_line(dumps(record))

    def sync(self) -> None:
        if not self.closed:
            try:
                os.fsync(self._fd)
            except OSError:
                pass

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            try:
                os.fsync(self._fd)
            except OSError:
                pass
            os.close(self._fd)


def hostname() -> str:
    return socket.gethostname() or "localhost"


def open_regular(path: str):
    """Open a trace or sidecar file for binary reading, only if it is a regular file: a FIFO
    or a device (a link to /dev/zero) named like a trace would block or never end."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
