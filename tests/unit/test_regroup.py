"""Re-reading a group's events (regroup.py) must give what decoding every line gives.

The reference is the plain reader the aligner and the divergence checks used before: each line
from the offset decoded with ``conform.parse_line`` (over-long lines skipped, reading stops at a
truncated last line). Files: the scale benchmark's synthetic traces and the loader fast-path
test's tricky lines (look-alike fields in strings, duplicate keys, errors, corrupt numbers, wrong
types), interleaved with other groups and other record kinds, read from several offsets and with
reads that end inside lines.
"""

from __future__ import annotations

import json

import pytest

from bench import synth
from ddpdoctor.analysis import conform, fastscan, regroup
from tests.unit.test_load_fastpath import HEADER, TRICKY, _line

_VARYING = ("s", "ts", "d", "step")


def _reference(path: str, group: str, offset: int) -> list[tuple[int, dict]]:
    out = []
    with open(path, "rb") as f:
        f.seek(offset)
        for start, raw in conform.bounded_lines(f):
            if raw is None:
                continue
            if not raw.endswith(b"\n"):
                break
            try:
                rec = conform.parse_line(raw)
            except (ValueError, RecursionError):
                continue
            if isinstance(rec, dict) and rec.get("t") == "c" and rec.get("g", "0") == group:
                out.append((offset + start, rec))
    return out


def _check(path: str, groups=("0", "7"), offsets=None) -> int:
    """Compare both readers on ``path`` from every line start in ``offsets`` (default: a few);
    returns how many lines were known by their shape (not decoded)."""
    data = open(path, "rb").read()
    starts = [0] + [i + 1 for i, b in enumerate(data) if b == 0x0A][:-1]
    shaped = 0
    for off in offsets if offsets is not None else starts[:: max(1, len(starts) // 7)]:
        for g in groups:
            want = _reference(path, g, off)
            assert list(regroup.group_events(path, g, off)) == want, (g, off)
            got = list(regroup.group_lines(path, g, off))
            assert [s for s, *_ in got] == [s for s, _ in want]
            for (_s, raw, rec, whole), (_s2, full) in zip(got, want):
                assert regroup.decode(raw, rec, whole) == full
                if not whole:  # a shape: equal but for the varying numbers
                    shaped += 1
                    assert {k: v for k, v in rec.items() if k not in _VARYING} == \
                        {k: v for k, v in full.items() if k not in _VARYING}
                    assert list(rec) == list(full)  # same keys, same order
    return shaped


@pytest.fixture(autouse=True)
def _fresh_shapes(monkeypatch):
    monkeypatch.setattr(regroup, "_KNOWN", {})


def test_synthetic_traces(tmp_path):
    synth.write(str(tmp_path), ranks=3, events=1500)
    files = sorted(tmp_path.glob("rank*.jsonl"))
    assert len(files) == 3
    assert all(_check(str(f), groups=("0",)) > 1000 for f in files)
    assert 0 < len(regroup._KNOWN) <= 8  # one entry a shape, shared by the files


@pytest.mark.parametrize("template", TRICKY)
def test_tricky_lines(tmp_path, template):
    path = tmp_path / "rank00000-h-1-a0.jsonl"
    lines = [json.dumps(HEADER)] + [_line(template, i) for i in range(40)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    _check(str(path))


@pytest.mark.parametrize("read", [61, 97, 4096, regroup.READ])
def test_mixed_damaged_file_any_read_size(tmp_path, monkeypatch, read):
    """Every kind interleaved, a second group, corrupt lines, an over-long line, a truncated tail;
    reads that end inside lines and inside numbers."""
    monkeypatch.setattr(conform, "MAX_LINE", 2000)
    monkeypatch.setattr(fastscan, "MAX_LINE", 2000)
    monkeypatch.setattr(regroup, "READ", read)
    path = tmp_path / "rank00000-h-1-a0.jsonl"
    lines = [json.dumps(HEADER)]
    for i in range(400):
        lines.append(_line(TRICKY[i % len(TRICKY)], i))
        lines.append(_line(TRICKY[0], i))
        if i % 11 == 0:
            lines.append(f'{{"t":"c","op":"barrier","g":"7","s":{i // 11 + 1},"ts":{i},"d":2,"site":9}}')
        if i % 50 == 0:
            lines.append('{"t":"c","op":"all_reduce","g":"0","s":012,"ts":1,"d":1,"site":1}')  # not JSON
            lines.append(f'{{"t":"e","op":"ddp_forward","g":"0","ts":{i},"d":1,"site":2}}')
            lines.append('{"t":"c","op":"x","g":"0","s":1,"x":["' + "q" * 2500 + '"],"ts":1,"d":1,"site":1}')
    lines.append('{"t":"c","op":"all_reduce","g":"0","s":9999,"ts":1')  # truncated: no newline
    path.write_text("\n".join(lines), encoding="utf-8")
    assert _check(str(path)) > 100


def test_surrogates_and_escapes_are_decoded(tmp_path):
    """Lines whose text parse_line rewrites (lone surrogates) or that hold escapes are never
    known by their shape: each is decoded."""
    path = tmp_path / "rank00000-h-1-a0.jsonl"
    tmpl = '{"t":"c","op":"all_reduce","g":"0","s":%d,"x":["\\ud800 \\u00e9"],"ts":%d,"d":%d,"site":1}'
    path.write_text("\n".join([json.dumps(HEADER)] + [_line(tmpl, i) for i in range(30)]) + "\n")
    got = list(regroup.group_lines(str(path), "0", 0))
    assert len(got) == 30 and all(whole for *_, whole in got)
    assert "\ud800" not in got[0][2]["x"][0] and "\u00e9" in got[0][2]["x"][0]  # as parse_line reads
    _check(str(path))


def test_unreadable_file_yields_nothing(tmp_path):
    assert list(regroup.group_lines(str(tmp_path / "missing.jsonl"), "0", 0)) == []
    assert list(regroup.group_events(str(tmp_path), "0", 0)) == []  # a folder, not a file
