"""The loader's fast path for ``c`` records must read exactly what json.loads reads.

Each file is read with ``load.FAST_PATH`` on and off (on: the C bulk path when it is built, and
the Python bulk path), and every field of the resulting
``RankTrace`` is compared: the synthetic traces of the scale benchmark, plus lines built to trip
a pattern-based reader (look-alike fields inside strings, leading zeros, duplicate keys, DDP
steps, errors, corrupt and truncated lines).
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from bench import synth
from ddpdoctor.analysis import conform, fastscan, load


def _fields(rt: load.RankTrace) -> dict:
    out = {}
    for f in dataclasses.fields(rt):
        v = getattr(rt, f.name)
        if f.name == "groups":
            v = {k: (g.count, g.blocks) for k, g in v.items()}
        elif f.name == "tail":
            v = list(v)
        out[f.name] = v
    return out


def _both(path) -> tuple[dict, dict]:
    """(reference, bulk path); with the C bulk path built, the Python bulk path must give the
    same as the C one (every dict in the same order too)."""
    old, native = load.FAST_PATH, fastscan.NATIVE
    try:
        load.FAST_PATH = False
        slow = _fields(load.read_rank(str(path)))
        load.FAST_PATH = True
        fast = _fields(load.read_rank(str(path)))
        if native is not None:
            fastscan.NATIVE = None
            py = _fields(load.read_rank(str(path)))
            assert py == fast
            assert [list(v) for v in py.values() if isinstance(v, dict)] == \
                [list(v) for v in fast.values() if isinstance(v, dict)]
    finally:
        load.FAST_PATH, fastscan.NATIVE = old, native
    return slow, fast


def test_synthetic_traces_read_the_same(tmp_path, monkeypatch):
    made = []
    real_make = load._Shape.make
    monkeypatch.setattr(load._Shape, "make", staticmethod(lambda *a: made.append(real_make(*a)) or made[-1]))
    p = synth.write(str(tmp_path), ranks=3, events=1500)
    files = sorted(tmp_path.glob("rank*.jsonl"))
    assert len(files) == 3
    for f in files:
        slow, fast = _both(f)
        assert slow == fast
        assert slow["events"] == p["events"]
        assert slow["groups"]["0"][0] == p["events"]
    # the fast path was taken: one shape per kind of event, not one per line (per bulk read)
    reads = 1 if fastscan.NATIVE is None else 2
    assert 0 < sum(s is not None for s in made) <= 3 * 6 * reads


HEADER = {"t": "header", "schema": 1, "run": "r", "rank": 0, "world": 2, "host": "h", "pid": 1,
          "attempt": 0}
# Lines as a writer (or a damaged file) could have them; each repeats so the fast path engages.
TRICKY = [
    '{"t":"c","op":"all_reduce","g":"0","s":%d,"x":["float32[4]"],"n":4,"rop":"SUM","ts":%d,"d":%d,"site":1}',
    '{"t":"c","op":"ddp_forward","g":"0","s":%d,"ts":%d,"d":%d,"site":2,"step":%d,"bufs":1,"grad":1}',
    '{"t":"c","op":"ddp_backward","g":"0","s":%d,"ts":%d,"d":%d,"site":2,"step":%d}',
    '{"t":"c","op":"barrier","g":"0","s":%d,"ts":%d,"d":%d,"site":-1,"async":1}',
    # look-alike fields inside a string value
    '{"t":"c","op":"x\\"s\\":1,","g":"0","s":%d,"x":["\\"ts\\":5,\\"d\\":6,"],"ts":%d,"d":%d,"site":3}',
    # the error text is part of the shape; errors are never taken by the fast path
    '{"t":"c","op":"all_reduce","g":"7","s":%d,"ts":%d,"d":%d,"site":4,"err":"RuntimeError: boom"}',
    # a later duplicate key wins in json.loads
    '{"t":"c","op":"broadcast","g":"0","s":%d,"ts":%d,"d":%d,"site":5,"root":0,"op":"gather"}',
    # non-ASCII text (UTF-8) between the fields the bulk path reads
    '{"t":"c","op":"all_reduce","g":"0","s":%d,"x":["float32[4]"],"obj":"caf\u00e9 \u2603","ts":%d,"d":%d,"site":6}',
    # numbers past the loader's integer bound make the line corrupt
    '{"t":"c","op":"all_reduce","g":"0","s":%d,"ts":%d,"d":%d99999999999999999999,"site":1}',
    # wrong types make the line corrupt
    '{"t":"c","op":"all_reduce","g":0,"s":%d,"ts":%d,"d":%d,"site":1}',
    '{"t":"c","op":"all_reduce","g":"0","s":%d,"ts":%d,"d":%d,"site":"x"}',
]


def _line(template: str, i: int) -> str:
    n = template.count("%d")
    return template % tuple([i + 1, 1000 * i + 7, 3 + i % 5, i // 2][:n])


@pytest.mark.parametrize("template", TRICKY)
def test_tricky_lines_read_the_same(tmp_path, template):
    path = tmp_path / "rank00000-h-1-a0.jsonl"
    lines = [json.dumps(HEADER)] + [_line(template, i) for i in range(40)]
    path.write_text("\n".join(lines) + "\n")
    slow, fast = _both(path)
    assert slow == fast


def test_mixed_and_damaged_file_reads_the_same(tmp_path):
    path = tmp_path / "rank00000-h-1-a0.jsonl"
    lines = [json.dumps(HEADER)]
    for i in range(600):  # past two digest blocks, every kind interleaved
        lines.append(_line(TRICKY[i % len(TRICKY)], i))
        if i % 50 == 0:
            lines.append('{"t":"c","op":"all_reduce","g":"0","s":012,"ts":1,"d":1,"site":1}')  # not JSON
            lines.append(f'{{"t":"file","op":"w","path":"/x","pos":{{"0":{i}}},"ts":{i},"site":1}}')
            lines.append(f'{{"t":"p","op":"send","g":"0","ch":"0>1","s":{i},"x":["float32[2]"],"n":2,'
                         f'"ts":{i},"d":1,"site":1}}')
    lines.append('{"t":"c","op":"all_reduce","g":"0","s":9999,"ts":1')  # truncated: no newline
    path.write_text("\n".join(lines))
    slow, fast = _both(path)
    assert slow == fast
    assert slow["truncated"] and slow["bad_lines"] > 0


def test_shape_then_odd_lines_and_chunk_boundaries(tmp_path, monkeypatch):
    """Lines of one shape interleaved with other kinds (p2p, DDP "e" records, a second group, an
    unknown record type), chunks ending in the middle of lines, a truncated last line."""
    path = tmp_path / "rank00000-h-1-a0.jsonl"
    lines = [json.dumps(HEADER)]
    for i in range(700):
        lines.append(_line(TRICKY[0], i))
        if i % 7 == 0:
            lines.append(f'{{"t":"e","op":"ddp_forward","g":"0","ts":{i},"d":1,"site":2}}')
        if i % 11 == 0:
            lines.append(f'{{"t":"c","op":"barrier","g":"7","s":{i // 11 + 1},"ts":{i},"d":2,"site":9}}')
        if i % 13 == 0:
            lines.append('{"t":"newer_kind","x":1}')
    lines.append('{"t":"c","op":"all_reduce","g":"0","s":9999')  # truncated: no newline
    path.write_text("\n".join(lines), encoding="utf-8")
    slow, fast = _both(path)
    assert slow == fast and slow["truncated"] and slow["events"] == 700 + 64
    for chunk in (61, 97, 4096):  # reads that end inside lines, inside numbers, between lines
        monkeypatch.setattr(fastscan, "CHUNK", chunk)
        assert _both(path) == (slow, fast)


def test_chunked_lines_are_the_bounded_lines(tmp_path, monkeypatch):
    """fastscan.chunks splits a file as conform.bounded_lines does: over-long lines (one
    ``None``), a last line without newline, NUL padding, empty lines, any read size."""
    monkeypatch.setattr(conform, "MAX_LINE", 50)
    monkeypatch.setattr(fastscan, "MAX_LINE", 50)
    bodies = [
        b"a\n" + b"b" * 50 + b"\n" + b"c" * 51 + b"\n" + b"d" * 120 + b"\n\n" + b"e\n" + b"f" * 50,
        b"x" * 200,
        b"\n".join([b"y" * 49, b"z" * 51, b"w"]) + b"\n" + b"\0" * 40,
        b"ok\n" + b"\0" * 60,
        "caf\u00e9\n\u2603\n".encode(),
        b"",
    ]
    for i, body in enumerate(bodies):
        path = tmp_path / f"f{i}"
        path.write_bytes(body)
        with open(path, "rb") as f:
            want = list(conform.bounded_lines(f))
        for chunk in (1, 7, 50, 51, 64, 1000):
            monkeypatch.setattr(fastscan, "CHUNK", chunk)
            with open(path, "rb") as f:
                assert list(fastscan._lines(f)) == want, (i, chunk)


def test_over_long_and_nul_padded_files_read_the_same(tmp_path, monkeypatch):
    monkeypatch.setattr(conform, "MAX_LINE", 300)
    monkeypatch.setattr(fastscan, "MAX_LINE", 300)
    monkeypatch.setattr(fastscan, "CHUNK", 300)
    path = tmp_path / "rank00000-h-1-a0.jsonl"
    lines = [json.dumps(HEADER)] + [_line(TRICKY[1], i) for i in range(50)]
    lines.insert(20, '{"t":"c","op":"x","g":"0","s":1,"x":["' + "q" * 400 + '"],"ts":1,"d":1,"site":1}')
    path.write_bytes(("\n".join(lines) + "\n").encode() + b"\0" * 250)
    slow, fast = _both(path)
    assert slow == fast and slow["bad_lines"] == 1 and not slow["truncated"] and slow["events"] == 50


def test_hostile_lines_read_in_linear_time(tmp_path):
    """Long lines full of look-alike fields (the chunk pattern must not backtrack over them):
    ~1 MB of them reads in well under a second; a quadratic scan would take minutes."""
    import time

    frag = b'"ts":1,"d":1,"site":1,"s":1,'
    bodies = [b'{"t":"c","op":"x","g":"0","s":1,' + frag * 10000 + b'"z":1\n',
              b'{"t":"c","op":"x","g":"0","s":1,"' + b'"' * 300000 + b"\n",
              b'{"t":"c","op":"x","g":"0","s":1,"ts":1,"d":1,"site":1' + b',"a":1' * 50000 + b"\n"]
    path = tmp_path / "rank00000-h-1-a0.jsonl"
    ok = b'{"t":"c","op":"x","g":"0","s":%d,"ts":1,"d":1,"site":1}\n'
    path.write_bytes(json.dumps(HEADER).encode() + b"\n" + b"".join(bodies)
                     + b"".join(ok % (i + 1) for i in range(100)))
    t = time.process_time()
    rt = load.read_rank(str(path))
    assert time.process_time() - t < 20
    assert rt.bad_lines == 3 and rt.events == 100



def test_barrier_successors_in_file_order(tmp_path):
    """Two barrier sites and several successors inside long runs of one group: the same counts
    as the line-by-line reader, first seen in the same order (report order follows it)."""
    path = tmp_path / "rank00000-h-1-a0.jsonl"
    ops = [("all_reduce", 1), ("barrier", 7), ("broadcast", 3), ("barrier", 8), ("all_reduce", 1),
           ("all_reduce", 2), ("barrier", 8), ("barrier", 7), ("broadcast", 3)]
    lines = [json.dumps(HEADER)]
    for i in range(900):
        op, site = ops[(i * 7 + i // 50) % len(ops)]
        lines.append(f'{{"t":"c","op":"{op}","g":"0","s":{i + 1},"ts":{10 * i},"d":{i % 9},"site":{site}}}')
    path.write_text("\n".join(lines) + "\n")
    slow, fast = _both(path)
    assert slow == fast and len(slow["after_barrier"]) >= 4
    assert list(slow["after_barrier"]) == list(fast["after_barrier"])
