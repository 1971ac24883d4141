"""The loader's ``c``-line pattern with possessive quantifiers (Python 3.11+) matches exactly
what the plain pattern matches, with the same groups, on ordinary and on look-alike lines."""

from __future__ import annotations

import sys

import pytest

from ddpdoctor.analysis import load

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
    b'{"t":"c","s":1,"s":2,"ts":1,"ts":2,"d":1,"site":1}\n',
    b'{"t":"c","op":"x","g":"0","s":1,"ts":1,"d":1,"site":1}}\n',
    b'{"t":"c",' + b'"a":"' + b'"' * 2000 + b'","s":1,"ts":1,"d":1,"site":1}\n',
]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="possessive quantifiers need Python 3.11")
def test_possessive_pattern_matches_like_the_plain_one():
    assert load._FAST_C is not load._FAST_C_PLAIN
    matched = 0
    for line in LINES:
        a, b = load._FAST_C_PLAIN.match(line), load._FAST_C.match(line)
        assert (a is None) == (b is None), line
        if a is not None:
            matched += 1
            assert a.groups() == b.groups() and a.regs == b.regs, line
    assert matched >= 5
