"""The memory-mapped trace writer: records across chunk boundaries, a second session appending,
the fall-back to os.write when space cannot be reserved, and how readers treat the reserved
NUL tail a killed rank leaves behind (docs/trace-format.md, Crash safety)."""

from __future__ import annotations

import errno
import json
import os

import ddpdoctor.trace.mappedtrace as mt
from ddpdoctor.analysis.load import read_rank


def _lines(n: int) -> list[str]:
    # lengths vary so that records straddle the 1 MiB chunk boundaries
    return [json.dumps({"t": "x", "i": i, "pad": "y" * (i % 97)}) for i in range(n)]


def test_records_cross_chunks_and_close_cuts_the_padding(tmp_path):
    path = tmp_path / "r.jsonl"
    w = mt.MappedTraceWriter(str(path))
    lines = _lines(20000)
    for line in lines:
        w.write_line(line)
    assert os.path.getsize(path) % mt.CHUNK == 0  # reserved ahead while open
    assert w.size() == sum(len(x) + 1 for x in lines)
    w.close()
    data = path.read_bytes()
    assert b"\0" not in data
    assert data.decode().splitlines() == lines
    w2 = mt.MappedTraceWriter(str(path))  # a second session of the process appends
    w2.write_line('{"t":"second"}')
    w2.close()
    assert path.read_bytes() == data + b'{"t":"second"}\n'


def test_reservation_failure_falls_back_to_write(tmp_path, monkeypatch):
    path = tmp_path / "r.jsonl"
    w = mt.MappedTraceWriter(str(path))

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(mt.os, "posix_fallocate", full)  # the disk is full from now on
    lines = _lines(20000)
    for line in lines:
        w.write_line(line)
    assert w._fallback
    w.close()
    assert path.read_bytes().decode().splitlines() == lines  # nothing lost, no padding


def test_readers_stop_at_the_reserved_tail(tmp_path):
    header = {"t": "header", "schema": 1, "run": "r", "rank": 0, "world": 1, "host": "h", "pid": 1,
              "attempt": 0, "torch": "2.x", "backend": "gloo", "wall0": 1.0}
    ev = {"t": "c", "op": "barrier", "g": "0", "s": 1, "ts": 5, "d": 1, "site": -1}
    body = (json.dumps(header) + "\n" + json.dumps(ev) + "\n").encode()
    killed = tmp_path / "rank00000-h-1-a0.jsonl"
    killed.write_bytes(body + b"\0" * 4096)  # died between records
    rt = read_rank(str(killed))
    assert rt.events == 1 and not rt.truncated and not rt.bad_lines
    cut = tmp_path / "rank00001-h-2-a0.jsonl"
    cut.write_bytes(body + b'{"t":"c","op":"bar' + b"\0" * 4096)  # died inside a store
    rt = read_rank(str(cut))
    assert rt.events == 1 and rt.truncated
