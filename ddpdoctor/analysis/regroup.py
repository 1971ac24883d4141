"""Reading one group's sequence events again from a byte offset, without decoding every line.

After loading, the aligner and the divergence checks re-read a block of each rank's file (where
the ranks' digests differ, the positions before a divergence): on 1,000 ranks that was ~600k
``json`` decodes in the report's own process, after the readers had finished (serial time). Here
a block is read like the loader's bulk path reads it (``fastscan``): one ``findall`` a chunk
splits the lines of the writer's layout into their shape key and numbers; the first line of each
shape is decoded and checked (:meth:`fastscan.Shape.make`), and the other lines of that shape are
known without decoding: the same record but for ``s``, ``ts``, ``d`` and ``step``. Every other
line is decoded, as before. What a caller sees is what decoding every line gives
(``tests/unit/test_regroup.py`` compares both).
"""

from __future__ import annotations

from collections.abc import Iterator

from ..trace.files import open_regular
from . import fastscan
from .conform import parse_line
from .fastscan import _GAP, _KEY, _LINE, _SCAN, Shape, _split, chunks

#: Distinct shapes remembered (a hostile file cannot grow the table without bound). Kept across
#: reads and files: a shape's verdict depends only on the line's text, and the ranks of a job
#: share their shapes, so each is checked once per report instead of once per rank and block.
_MAX_SHAPES = 4096
_KNOWN: dict[tuple, dict | None] = {}
_NO_BARRIERS: frozenset = frozenset()
#: Bytes a read: a block of 256 events is ~30 KB and a caller often stops within it; what is read
#: past the caller's last event (at most one read) is matched for nothing.
READ = 8 << 10


def _template(raw: bytes) -> dict | None:
    """The record of ``raw`` when every line of its shape is that record but for the numbers
    ``s``/``ts``/``d``/``step``; None otherwise (then each line of the shape is decoded)."""
    if b"\\" in raw or b"\xed" in raw:  # escapes, surrogates: parse_line may rewrite the text
        return None
    try:
        rec = parse_line(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(rec, dict) or Shape.make(raw, rec, None, _NO_BARRIERS) is None:
        return None
    return rec


def group_lines(path: str, group: str, offset: int) -> Iterator[tuple[int, bytes, dict, bool]]:
    """``(byte offset, line, record, whole)`` of each ``c`` event of ``group`` in the file from
    ``offset``, in file order, read as ``load.iter_records`` reads (corrupt and over-long lines
    skipped, reading stops at a truncated last line, an unreadable file yields nothing).

    ``whole``: ``record`` is the decoded line. Otherwise it is the line's *shape* (a dict shared
    by the lines of that shape, not to be modified): equal to the decoded line in every field but
    ``s``, ``ts``, ``d`` and ``step``; :func:`decode` gives the whole record."""
    try:
        f = open_regular(path)
    except OSError:
        return
    known = _KNOWN
    with f:
        if offset:
            f.seek(offset)
        for off, item in chunks(f, READ):
            if item is None:  # an over-long line: corrupt
                continue
            if not item.endswith(b"\n"):
                return  # a truncated last line
            pos = offset + off
            native = fastscan.NATIVE
            for raw, key in native.lines(item) if native is not None else _rows(item):
                if key is None:
                    rec = _decoded(raw)
                    if rec is not None and rec.get("t") == "c" and rec.get("g", "0") == group:
                        yield pos, raw, rec, True
                    pos += len(raw)
                    continue
                tmpl = known.get(key, known)
                if tmpl is known:  # a shape not seen yet in this read
                    tmpl = _template(raw)
                    if len(known) < _MAX_SHAPES:
                        known[key] = tmpl
                if tmpl is None:
                    rec = _decoded(raw)
                    if rec is not None and rec.get("t") == "c" and rec.get("g", "0") == group:
                        yield pos, raw, rec, True
                elif tmpl.get("g", "0") == group:
                    yield pos, raw, tmpl, False
                pos += len(raw)


def _rows(item: bytes) -> list:
    """``(line, shape key or None)`` of each line of ``item`` (whole lines), by the pattern; the C
    scanner's ``lines`` gives the same without the regex."""
    out = []
    for row in _SCAN.findall(item):
        if row[_GAP]:
            out.extend((raw, None) for raw in _split(row[_GAP]))
        if row[_LINE]:
            out.append((row[_LINE], _KEY(row)))
    return out


def _decoded(raw: bytes) -> dict | None:
    try:
        rec = parse_line(raw)
    except (ValueError, RecursionError):
        return None
    return rec if isinstance(rec, dict) else None


def decode(raw: bytes, rec: dict, whole: bool) -> dict:
    """The whole record of a line that :func:`group_lines` yielded."""
    return rec if whole else parse_line(raw)


def group_events(path: str, group: str, offset: int) -> Iterator[tuple[int, dict]]:
    """``(byte offset, record)`` of each ``c`` event of ``group`` from ``offset``: each record
    decoded (:func:`group_lines` for the cheaper form)."""
    for start, raw, rec, whole in group_lines(path, group, offset):
        yield start, (rec if whole else parse_line(raw))
