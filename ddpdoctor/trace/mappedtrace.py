"""The trace file written through shared memory: a store per record instead of a ``write``.

Measured with callgrind and strace (bench/instructions.py): ``os.write`` per record was one
syscall per collective plus the GIL's release and re-acquisition around it. Here the file is
grown in reserved chunks that are mapped ``MAP_SHARED``; a record is one ``mmap.write`` (a
memcpy under the GIL, so records of different threads never interleave, and no lock is taken
on the hot path). Stores into a shared file mapping belong to the page cache, not to the
process: they survive SIGKILL and a native crash exactly like the in-flight slot does.

Every chunk is reserved with ``os.posix_fallocate`` *before* it is mapped: a store into a
mapped page the file system cannot back (a full disk, a sparse hole) is a SIGBUS that would
kill the traced program. When the reservation fails the writer falls back to ``os.write``
(which fails with an error the recorder logs, never a signal).

The file ends in NUL padding while it is being written (the unused part of the last chunk);
``close`` cuts it to the records' length. A rank that dies leaves the padding behind:
readers stop at the first line that starts with a NUL byte (docs/trace-format.md).
"""

from __future__ import annotations

import mmap
import os
import threading

from .files import dumps

#: Bytes reserved and mapped at a time. A 1-element collective writes ~150 B: ~7000 records.
CHUNK = 1 << 20


class MappedTraceWriter:
    """Appends records to one rank's trace file; safe to call from several threads.

    Same interface as ``tracefile.TraceWriter``; the recorder's hot path calls
    ``writer.mm.write(data)`` itself and falls back to ``append`` on ``ValueError`` (the chunk
    is full, or the writer was closed)."""

    def __init__(self, path: str) -> None:
        self.path = path
        # Appends to an existing file (a second recording session of the same process).
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        self.closed = False
        self._lock = threading.Lock()
        self._base = 0  # file offset of the current chunk
        self.mm: mmap.mmap | None = None
        self._fallback = False  # reservation failed: plain appends from here on
        try:
            end = os.fstat(self.fd).st_size
            base = end - end % mmap.ALLOCATIONGRANULARITY  # mappings start on a page boundary
            self._map(base)
            self.mm.seek(end - base)
        except (OSError, ValueError):
            os.close(self.fd)
            raise

    def _map(self, base: int) -> None:
        os.posix_fallocate(self.fd, base, CHUNK)  # reserve first: a mapping can never SIGBUS
        self.mm = mmap.mmap(self.fd, CHUNK, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=base)
        self._base = base

    def append(self, data: bytes) -> None:
        """Append encoded bytes (one or more whole records)."""
        mm = self.mm
        if mm is not None:
            try:
                mm.write(data)
                return
            except ValueError:  # chunk full (or closed): the slow path below, under the lock
                pass
        with self._lock:
            while not self.closed and not self._fallback:
                mm = self.mm
                room = CHUNK - mm.tell()
                try:
                    if len(data) <= room:
                        mm.write(data)
                        return
                    # The record continues in the next chunk: the file stays contiguous.
                    mm.write(data[:room])
                except ValueError:  # another thread's record came first: measure again
                    continue
                data = data[room:]
                try:
                    self._map(self._base + CHUNK)
                except OSError:  # no room left on the device: plain appends from here on
                    self._fallback = True
                    self.mm = None
                    os.ftruncate(self.fd, self._base + CHUNK)
                    os.lseek(self.fd, self._base + CHUNK, os.SEEK_SET)
                try:
                    mm.close()  # a thread still about to store into it gets ValueError: retries
                except (BufferError, ValueError):
                    pass
            if self._fallback and not self.closed:
                os.write(self.fd, data)

    def write_line(self, line: str) -> None:
        """Write one already-encoded record (without its newline)."""
        if not self.closed:
            self.append((line + "\n").encode("utf-8", "backslashreplace"))

    def write(self, record: dict) -> None:
        self.write_line(dumps(record))

    def size(self) -> int:
        """Bytes of records written so far."""
        mm = self.mm
        if mm is None or self._fallback:
            return os.lseek(self.fd, 0, os.SEEK_CUR) if not self.closed else os.path.getsize(self.path)
        return self._base + mm.tell()

    def sync(self) -> None:
        if not self.closed:
            try:
                if self.mm is not None:
                    self.mm.flush()
                os.fsync(self.fd)
            except (OSError, ValueError):
                pass

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            mm, self.mm = self.mm, None
            try:
                if mm is not None and not self._fallback:
                    end = self._base + mm.tell()
                    mm.flush()
                    mm.close()
                    os.ftruncate(self.fd, end)  # no padding in a file that was closed
                os.fsync(self.fd)
            except (OSError, ValueError, BufferError):
                pass
            os.close(self.fd)
