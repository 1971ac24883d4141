"""The loader's ``c``-line pattern (analysis/fastscan.py): the possessive form (Python 3.11+)
matches exactly what the plain form matches, with the same groups, on ordinary and look-alike
lines; the chunk scanner splits a chunk into the same shape keys as the line pattern."""

from __future__ import annotations

import sys

import pytest

from ddpdoctor.analysis import fastscan

LINES = [
    b'{"t":"c","op":"all_reduce","g":"0","s":101,"x":["float32[1024]"],"n":1024,"rop":"SUM","ts":301000,"d":569,"site":1}\n',
    b'{"t":"c","op":"ddp_forward","g":"0","s":7,"ts":0,"d":0,"site":-3,"step":12}\n',
    b'{"t":"c","op":"ddp_forward","g":"0","s":7,"ts":0,"d":0,"site":3,"step":012}\n',
    b'{"t":"c","op":"x","g":"\\"s\\":1,","s":2,"ts":3,"d":4,"site":5}\n',
    b'{"t":"c","op":"a\\"s\\":9,","g":"0","s":1,"x":["\\"ts\\":5,"],"ts":6,"d":7,"site":8,"z":"}"}\n',
    b'{"t":"c","op":"x","g":"0","s":01,"ts":1,"d":1,"site":1}\n',
    b'{"t":"c","op":"x","g":"0","s":1,"ts":1,"d":1,"site":1}',
    b'{"t":"c","op":"x","g":"0","s":1,"ts":1,"d":1,"site":1,"step":}\n',
    b'{"t":"c","op":"x","g":"0","s":1,"ts":1,"d":1,"site":12345678901234567890,"k":[1,2]}\n',
    b'{"t":"c","op":"x","g":"0","s":1,"ts":1234567890123456789,"d":1,"site":1}\n',
    b'{"t":"c","s":1,"s":2,"ts":1,"ts":2,"d":1,"site":1}\n',
    b'{"t":"c","op":"x","g":"0","s":1,"ts":1,"d":1,"site":1}}\n',
    b'{"t":"c","op":"x","g":"0","s":1,' + b'"a":"' + b'"' * 2000 + b'","ts":1,"d":1,"site":1}\n',
    '{"t":"c","op":"x","g":"0","s":1,"x":["é\u2028"],"ts":1,"d":1,"site":1}\n'.encode(),
]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="possessive quantifiers need Python 3.11")
def test_possessive_pattern_matches_like_the_plain_one():
    assert fastscan.LINE is not fastscan.LINE_PLAIN
    matched = 0
    for line in LINES:
        a, b = fastscan.LINE_PLAIN.match(line), fastscan.LINE.match(line)
        assert (a is None) == (b is None), line
        if a is not None:
            matched += 1
            assert a.groups() == b.groups() and a.regs == b.regs, line
    assert matched >= 6


def test_chunk_rows_have_the_line_keys():
    """Every line the line pattern matches is one row of the chunk scan, with the same key, and
    the rows' gaps and lines put together are the chunk."""
    chunk = b"".join(x if x.endswith(b"\n") else x + b"\n" for x in LINES)
    chunk += b'{"t":"p","op":"send","g":"0","ch":"0>1","s":1,"ts":1,"d":1,"site":1}\n'
    rows = fastscan._SCAN.findall(chunk)
    taken = [r for r in rows if r[fastscan._LINE]]
    want = [fastscan.line_key(m) for m in map(fastscan.LINE.match, chunk.splitlines(keepends=True)) if m]
    assert [fastscan._KEY(r) for r in taken] == want
    assert len(want) >= 6
    assert b"".join(r[fastscan._GAP] + r[fastscan._LINE] for r in rows) == chunk
