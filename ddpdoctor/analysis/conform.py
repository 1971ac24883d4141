"""The loader's trust boundary: a trace file is untrusted input. Lines are bounded, decoded
safely (lone surrogates replaced), and fields readers compute with are type-checked, with
numbers finite and of sane magnitude; a field of the wrong type is dropped or its record skipped
as corrupt, never passed on to a check or a renderer."""

from __future__ import annotations

import json
import math
import re

#: Longest line read as a record; no writer makes longer ones, so a longer line is corrupt (and
#: reading it whole would cost memory and time without bound).
MAX_LINE = 1 << 20
#: Largest world size believed from a header (anything larger is a damaged or hostile file).
MAX_WORLD = 1 << 20
_INT_LIMIT = 1 << 62



# Fields whose type the loader relies on; a record with another type there is skipped as corrupt.
_TYPED = (("t", str), ("op", str), ("g", str), ("ch", str), ("d", int), ("ts", (int, float)),
          ("s", int), ("site", (int, type(None))))


def well_typed(rec: dict) -> bool:
    """The fields the loader computes with have their type (null only for ``site``), and their
    numbers are finite and of sane magnitude."""
    for key, typ in _TYPED:
        if key not in rec:
            continue
        v = rec[key]
        if v is None and key == "site":
            continue
        if not isinstance(v, typ):
            return False
        if typ is not str and not (-_INT_LIMIT < v < _INT_LIMIT and (type(v) is not float or math.isfinite(v))):
            return False
    return True


# A lone UTF-16 surrogate, escaped (\ud800) or as raw bytes: json.loads accepts both, and such a
# string cannot be encoded again (UnicodeEncodeError wherever it is written or hashed).
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


def parse_line(raw: bytes):
    """One record line decoded: json.loads, with lone surrogates replaced by U+FFFD.
    Raises ValueError (not JSON, not UTF-8) or RecursionError (absurd nesting)."""
    rec = json.loads(raw)
    if _SURROGATE.search(raw) is not None:
        text = json.dumps(rec, ensure_ascii=False).encode("utf-8", "replace").decode("utf-8")
        rec = json.loads(text)
    return rec


def bounded_lines(f):
    """The lines of a binary file, each at most MAX_LINE bytes: an over-long line is yielded as
    one ``None`` (the caller counts it as corrupt) and its remainder skipped. A last line without
    its newline is yielded as read (truncated). Yields (offset of the line, line or None)."""
    offset = 0
    skipping = False
    readline = f.readline
    limit = MAX_LINE + 1
    while True:
        raw = readline(limit)
        if not raw:
            return
        start = offset
        offset += len(raw)
        if skipping:
            skipping = not raw.endswith(b"\n")
            continue
        if len(raw) == limit and not raw.endswith(b"\n"):
            skipping = True
            yield start, None
            continue
        yield start, raw



_NUM = (int, float)
_STR = (str,)
#: Optional header fields and their types: a field of another type is dropped (reported as
#: absent), so that no renderer meets a number where it expects a list.
HEADER_TYPES = {"host": _STR, "torch": _STR, "backend": _STR, "python": _STR, "tool": _STR,
                 "argv": (list,), "wall0": _NUM, "pid": (int,), "local_rank": (int,),
                 "pg_timeout_s": _NUM + (type(None),), "hang_timeout_s": _NUM + (type(None),)}
#: Container fields of rare records that checks iterate: one of another type is dropped.
RARE_TYPES = {"exit": {"inflight": (list,), "stack": (list,), "exc": _STR, "how": _STR, "file": _STR,
                        "line": (int,), "func": _STR, "seq": (dict,)},
               "pg": {"ranks": (list,), "op": _STR},
               "file": {"pos": (dict,), "done": (dict,), "path": _STR, "to": _STR, "op": _STR},
               "hang": {"status": (dict,), "diag": (dict,), "role": _STR},
               "sampler": {"created": (int, type(None))}}
_SITE_TYPES = {"file": _STR, "line": (int,), "func": _STR, "src": _STR, "stack": (list,),
               "conds": (list,), "via": _STR}


def conform(rec: dict, types: dict) -> None:
    """Drop the fields of ``rec`` whose type is not the one readers rely on; numbers must be
    finite and of sane magnitude, lists hold only plain values."""
    for key, typ in types.items():
        if key not in rec:
            continue
        v = rec[key]
        ok = isinstance(v, typ) and not (isinstance(v, bool) and bool not in typ)
        if ok and isinstance(v, (int, float)) and not isinstance(v, bool):
            ok = -_INT_LIMIT < v < _INT_LIMIT and (type(v) is not float or math.isfinite(v))
        if ok and key == "argv":
            ok = all(isinstance(a, str) for a in v)
        if not ok:
            del rec[key]


def frame_ok(fr) -> bool:
    return (isinstance(fr, list) and len(fr) >= 4 and isinstance(fr[0], str) and type(fr[1]) is int
            and all(isinstance(x, str) for x in fr[2:4]))


def conform_site(rec: dict) -> bool:
    """A call-site record readers can use: an integer id; wrong-typed fields, malformed stack
    frames and branch conditions dropped."""
    if type(rec.get("id")) is not int:
        return False
    conform(rec, _SITE_TYPES)
    if "stack" in rec:
        rec["stack"] = [fr for fr in rec["stack"] if frame_ok(fr)]
    if "conds" in rec:
        rec["conds"] = [c for c in rec["conds"] if frame_ok(c)]
    return True


def header_valid(h: dict) -> bool:
    """Header fields every reader computes with: integers in range, a string run id."""
    def nat(key, hi=_INT_LIMIT, default=0):
        v = h.get(key, default)
        return type(v) is int and 0 <= v < hi

    run = h.get("run", "")
    return (nat("schema") and nat("rank", MAX_WORLD, -1) and nat("world", MAX_WORLD + 1)
            and nat("attempt") and isinstance(run, (str, type(None)))
            and isinstance(h.get("_groups", {}), dict))
