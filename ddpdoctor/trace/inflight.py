"""The call a rank is inside right now, in a small memory-mapped file next to its trace.

Events are written when a call returns. A rank that dies inside the call — gloo aborts the
process (SIGABRT, "Received data size doesn't match") when ranks pass tensors of different sizes,
SIGKILL, a segfault — would take the call's metadata with it. Writing it to a ``MAP_SHARED``
mapping before the call costs a memory copy, not a syscall, and the kernel keeps the page when
the process dies, so the reader can tell which call a dead rank was in, and with what shapes.
"""

from __future__ import annotations

import errno
import mmap
import os

SIZE = 16384
SUFFIX = ".inflight"


class InflightSlot:
    def __init__(self, path: str) -> None:
        self.path = path
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            reserve(fd, SIZE)
            self._mm = mmap.mmap(fd, SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            try:
                os.unlink(path)
            except OSError:
                pass
            raise
        os.close(fd)

    def set(self, line: str) -> None:
        """Record one JSON line (the call about to block); longer ones are not kept."""
        data = line.encode("utf-8", "backslashreplace") + b"\n"
        if len(data) < SIZE:
            self._mm[: len(data)] = data

    def close(self) -> None:
        try:
            self._mm.close()
        except (BufferError, ValueError):
            pass


def reserve(fd: int, size: int) -> None:
    """Give the file real blocks before it is mapped. A store into a mapped page that the
    filesystem cannot back (a sparse file on a full disk) kills the process with SIGBUS, so a
    slot that cannot be backed must fail here, with an OSError (the caller goes on without it),
    never later inside the program."""
    try:
        os.posix_fallocate(fd, 0, size)
        return
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise  # ENOSPC, EDQUOT...
    except AttributeError:  # no posix_fallocate on this platform
        pass
    # Filesystems without fallocate: write the zeros (a write that cannot be backed fails).
    zeros = bytes(size)
    done = 0
    while done < size:
        done += os.pwrite(fd, zeros[done:], done)
    os.fsync(fd)


def read(path: str) -> str | None:
    """The last call recorded in an in-flight file, or None."""
    from .files import open_regular

    try:
        with open_regular(path) as f:  # never a FIFO or a device named like a slot
            data = f.read(SIZE)
    except OSError:
        return None
    line, sep, _ = data.partition(b"\n")
    if not sep or not line.strip(b"\0 "):
        return None
    return line.decode("utf-8", "replace")
