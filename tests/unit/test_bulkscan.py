"""The C bulk path (analysis/_bulkscan.c) reads exactly what the Python paths read.

The Python regex path stays the reference: the C scanner's line matcher gives the pattern's shape
keys and numbers, its crc32 is zlib's, and whole files of hostile bytes (truncated lines, NUL
padding, escapes, over-long lines, numbers of 18/19 digits, CRLF, invalid UTF-8, reads ending
inside lines) load into the same ``RankTrace`` three ways: json for every line, the Python bulk
path, the C bulk path.
"""

from __future__ import annotations

import dataclasses
import json
import random
import types
import zlib

import pytest

from ddpdoctor.analysis import conform, fastscan, load, native

pytestmark = pytest.mark.skipif(fastscan.NATIVE is None,
                                reason="the C bulk path is not built (no compiler at install) or DDPDOCTOR_NATIVE=0")

HEADER = {"t": "header", "schema": 1, "run": "r", "rank": 0, "world": 2, "host": "h", "pid": 1,
          "attempt": 0}
# the writer's layouts (s, ts, d[, step] filled in), a few look-alikes, a second group, a barrier
SHAPES = [
    '{"t":"c","op":"all_reduce","g":"0","s":%d,"x":["float32[4]"],"n":4,"rop":"SUM","ts":%d,"d":%d,"site":1}',
    '{"t":"c","op":"ddp_forward","g":"0","s":%d,"ts":%d,"d":%d,"site":2,"step":%d,"bufs":1,"grad":1}',
    '{"t":"c","op":"ddp_backward","g":"0","s":%d,"ts":%d,"d":%d,"site":2,"step":%d}',
    '{"t":"c","op":"barrier","g":"0","s":%d,"ts":%d,"d":%d,"site":-1}',
    '{"t":"c","op":"broadcast","g":"1","s":%d,"x":["\\"ts\\":5,"],"ts":%d,"d":%d,"site":3,"root":0}',
    '{"t":"c","op":"all_gather","g":"1","s":%d,"obj":"caf\u00e9","ts":%d,"d":%d,"site":4}',
]
OTHER = [
    '{"t":"e","op":"ddp_forward","g":"0","ts":%d,"d":1,"site":2,"grad":1}',
    '{"t":"w","op":"all_reduce","g":"0","s":%d,"ts":5,"d":2}',
    '{"t":"p","op":"send","g":"0","ch":"0>1","s":%d,"x":["float32[2]"],"n":2,"ts":1,"d":1,"site":1}',
    '{"t":"site","id":%d,"file":"t.py","line":3,"func":"f","src":"x","stack":[]}',
]


def _fields(rt: load.RankTrace) -> dict:
    out = {}
    for f in dataclasses.fields(rt):
        v = getattr(rt, f.name)
        if f.name == "groups":
            v = {k: (g.count, g.blocks, g._op, g._sig) for k, g in v.items()}
        elif f.name == "tail":
            v = list(v)
        out[f.name] = v
    return out


def _three(path) -> dict:
    """The RankTrace read by json alone, by the Python bulk path and by the C bulk path: equal,
    dicts in the same order; and the C path was used."""
    made = []
    real = fastscan.NATIVE
    counting = types.SimpleNamespace(Scanner=lambda *a: made.append(1) or real.Scanner(*a))
    old = load.FAST_PATH
    try:
        load.FAST_PATH = False
        ref = _fields(load.read_rank(str(path)))
        load.FAST_PATH = True
        fastscan.NATIVE = None
        py = _fields(load.read_rank(str(path)))
        fastscan.NATIVE = counting
        c = _fields(load.read_rank(str(path)))
    finally:
        load.FAST_PATH, fastscan.NATIVE = old, real
    assert made, "the C path was not used"
    assert ref == py
    assert c == py
    assert [list(v) for v in c.values() if isinstance(v, dict)] == [list(v) for v in py.values() if isinstance(v, dict)]
    return c


def _good(rng: random.Random, i: int) -> bytes:
    t = SHAPES[rng.randrange(len(SHAPES))]
    nums = [i + 1, 1000 * i + rng.randrange(50), rng.randrange(9), i // 2][:t.count("%d")]
    return (t % tuple(nums)).encode()


def _hostile(rng: random.Random, line: bytes) -> bytes:
    """A damaged or unusual form of a line (without its newline)."""
    k = rng.randrange(14)
    if k == 0:  # truncated inside
        return line[:rng.randrange(1, len(line))]
    if k == 1:  # NUL bytes inside
        at = rng.randrange(len(line))
        return line[:at] + b"\0" * rng.randrange(1, 4) + line[at:]
    if k == 2:  # an escape inside a string
        return line.replace(b'"op":"', b'"op":"\\"s\\":1,\\u00e9', 1)
    if k == 3:  # numbers of 18 and 19 digits in every numeric field
        digits = rng.choice([b"999999999999999999", b"1000000000000000000", b"123456789012345678"])
        for f in (b'"s":', b'"ts":', b'"d":', b'"step":', b'"site":'):
            at = line.find(f)
            if at >= 0 and rng.random() < 0.5:
                end = at + len(f)
                while end < len(line) and line[end:end + 1].isdigit():
                    end += 1
                line = line[:at + len(f)] + digits + line[end:]
        return line
    if k == 4:  # CRLF
        return line + b"\r"
    if k == 5:  # invalid UTF-8, a lone surrogate
        return line.replace(b'"g":"', rng.choice([b'"g":"\xff', b'"g":"\xed\xa0\x80', b'"g":"\xc3']), 1)
    if k == 6:  # leading zeros
        return line.replace(b'"d":', b'"d":0', 1)
    if k == 7:  # a duplicate key: the later one wins in json
        return line[:-1] + b',"op":"gather"}'
    if k == 8:  # a step key with no number, or a bad one
        return line[:-1] + rng.choice([b',"step":}', b',"step":x}', b',"step":0123}'])
    if k == 9:  # a random byte changed
        at = rng.randrange(len(line))
        return line[:at] + bytes([rng.randrange(256)]) + line[at + 1:]
    if k == 10:  # look-alike fields later in the line
        return line[:-1] + b',"z":"\\"ts\\":1,\\"d\\":2"}'
    if k == 11:  # a space (still JSON, not the writer's layout)
        return line.replace(b",", b", ", 1)
    if k == 12:  # a brace before the end
        return line + b"}"
    return line.replace(b'"site":', b'"site":-', 1)  # a negative site


def _file(rng: random.Random, n: int, rate: float) -> bytes:
    out = [json.dumps(HEADER).encode()]
    for i in range(n):
        r = rng.random()
        if r < rate:
            out.append(_hostile(rng, _good(rng, i)))
        elif r < rate + 0.05:
            o = OTHER[rng.randrange(len(OTHER))]
            out.append((o % i).encode())
        else:
            out.append(_good(rng, i))
    body = b"\n".join(out) + b"\n"
    end = rng.randrange(4)
    if end == 1:
        body += b"\0" * rng.randrange(1, 300)  # space a mapped file had reserved
    elif end == 2:
        body += _good(rng, n)[:rng.randrange(1, 40)]  # a rank killed mid-write
    return body


@pytest.mark.parametrize("seed", range(40))
def test_hostile_files_read_the_same(tmp_path, monkeypatch, seed):
    rng = random.Random(seed)
    path = tmp_path / "rank00000-h-1-a0.jsonl"
    path.write_bytes(_file(rng, rng.choice([60, 400, 1500]), rng.choice([0.0, 0.02, 0.2, 0.6])))
    if seed % 4 == 1:  # reads ending inside lines and numbers
        monkeypatch.setattr(fastscan, "CHUNK", rng.choice([61, 97, 1000, 4096]))
    if seed % 4 == 2:  # over-long lines
        monkeypatch.setattr(conform, "MAX_LINE", 120)
        monkeypatch.setattr(fastscan, "MAX_LINE", 120)
        monkeypatch.setattr(fastscan, "CHUNK", 120)
    _three(path)


def test_long_clean_file_and_many_blocks(tmp_path):
    """Several digest blocks per group, two groups interleaved, DDP steps, barriers."""
    rng = random.Random(7)
    path = tmp_path / "rank00000-h-1-a0.jsonl"
    path.write_bytes(_file(rng, 6000, 0.0))
    rt = _three(path)
    assert rt["events"] > 5000 and len(rt["groups"]["0"][1]) > 10 and rt["after_barrier"]
    assert rt["ddp_steps"]["ddp_forward"] > 0 and rt["ddp_train_fwd"] > 0


def test_huge_durations_do_not_overflow(tmp_path):
    """d of 18 digits on many lines: sums past 2**64 (the C path's counters flush before)."""
    path = tmp_path / "rank00000-h-1-a0.jsonl"
    big = 999999999999999999
    lines = [json.dumps(HEADER)] + [
        f'{{"t":"c","op":"all_reduce","g":"0","s":{i + 1},"ts":{big - i},"d":{big - i % 3},"site":1}}'
        for i in range(100)]
    path.write_text("\n".join(lines) + "\n")
    _three(path)
    rt = load.read_rank(str(path))
    assert rt.waits["all_reduce"] == [100, sum(big - i % 3 for i in range(100)), big]
    assert rt.last_ts == 2 * big


def _pattern_view(line: bytes):
    """What the regex path takes from one whole line: (key, ts, d), or None."""
    rows = fastscan._SCAN.findall(line)
    if not rows or not rows[0][fastscan._LINE]:
        return None
    row = rows[0]
    return fastscan._KEY(row), int(row[fastscan._TS]), int(row[fastscan._D])


def test_line_matcher_is_the_pattern():
    rng = random.Random(3)
    lines = [_good(rng, i) for i in range(50)]
    lines += [_hostile(rng, _good(rng, i)) for i in range(3000)]
    lines += [b'{"t":"c","op":"x","g":"0","s":1,"ts":1,"d":1,"site":12345678901234567890,"k":[1,2]}',
              b'{"t":"c","op":"x","g":"0","s":1,"ts":1,"d":1,"site":1,"step":1234567890123456789}',
              b'{"t":"c","op":"x","g":"0","s":1,"ts":1,"d":1,"site":1,"step":0}',
              b'{"t":"c","op":"x","g":"0","s":0,"ts":0,"d":0,"site":-0}',
              b'{"t":"c","op":"x","g":"0","s":1,"ts":1,"d":1,"site":-}',
              b'{"t":"c","op":"x","g":"0","s":1,"ts":1,"d":1,"site":1',
              b'{"t":"c","op":"x","g":"0","s":1,"ts":1,"d":1,"site":1}}',
              b'{"t":"c","op":"x","g":"0","s":1,' + b'"' * 500 + b'ts":1,"d":1,"site":1}',
              b'{"t":"c","op":"","g":"","s":1,"ts":1,"d":1,"site":1}',
              b'{"t":"c","op":"x","g":"0","s":1,"ts":1,"d":1,"site":1\r}']
    taken = 0
    for line in lines:
        for raw in (line + b"\n", line):
            want = _pattern_view(raw) if raw.endswith(b"\n") and raw.count(b"\n") == 1 else None
            got = fastscan.NATIVE.match(raw)
            assert got == want, raw
            taken += got is not None
    assert taken > 500


def test_crc32_is_zlibs():
    rng = random.Random(5)
    crc = 0
    for n in list(range(40)) + [255, 256, 1000, 4099]:
        data = bytes(rng.randrange(256) for _ in range(n))
        assert fastscan.NATIVE.crc32(data, crc) == zlib.crc32(data, crc)
        crc = zlib.crc32(data, crc)
    assert fastscan.NATIVE.crc32(b"") == 0


def test_bad_arguments_raise_not_crash():
    sc = fastscan.NATIVE.Scanner(load.RankTrace(path="x"), {}, 256, frozenset(), ("ddp_forward",))
    with pytest.raises(TypeError):
        sc.run("text", 0, 0)
    with pytest.raises(ValueError):
        sc.run(b"x\n", 5, 0)
    assert sc.run(b"", 0, 0) == (0, 0, None)
    assert sc.run(b"not json\n", 0, 10) == (0, 9, None)
    assert sc.finish() == (0, 0)
    with pytest.raises(ValueError):
        fastscan.NATIVE.Scanner(load.RankTrace(path="x"), {}, 0, frozenset(), ())


def test_native_switch(monkeypatch):
    monkeypatch.setenv("DDPDOCTOR_NATIVE", "0")
    assert native.load("_bulkscan") is None
    monkeypatch.setenv("DDPDOCTOR_NATIVE", "1")
    assert native.load("_bulkscan") is fastscan.NATIVE
    assert native.load("_no_such_module") is None


def test_lines_are_the_pattern_rows():
    """regroup's split of a read: the C ``lines`` gives the pattern's rows, gap lines one by one."""
    from ddpdoctor.analysis import regroup

    for seed in range(12):
        rng = random.Random(100 + seed)
        body = _file(rng, 300, rng.choice([0.0, 0.3, 0.8]))
        item = body[:body.rfind(b"\n") + 1]
        got = fastscan.NATIVE.lines(item)
        assert got == regroup._rows(item)
        assert b"".join(raw for raw, _ in got) == item
        assert any(k is not None for _, k in got)
