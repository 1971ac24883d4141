"""Suppression comments: ``# ddpdoctor: ignore[DD001] reason`` (or ``ignore[DD001,DD003]``, or a
category name, or a bare ``# ddpdoctor: ignore``) on any line the finding points at (its
communication, its condition, its write/read), or on the line above it."""

from __future__ import annotations

import io
import re
import tokenize

_RE = re.compile(r"#\s*ddpdoctor\s*:\s*ignore(?:\[([^\]]*)\])?", re.IGNORECASE)


def comments(source: str) -> dict[int, set[str] | None]:
    """line -> ids/categories suppressed there (None: everything)."""
    out: dict[int, set[str] | None] = {}
    if "ddpdoctor" not in source:
        return out
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError, IndentationError):
        return out
    for tok in tokens:
        if tok.type != tokenize.COMMENT:
            continue
        m = _RE.search(tok.string)
        if not m:
            continue
        line = tok.start[0]
        if m.group(1) is None:
            out[line] = None
        else:
            names = {x.strip().upper() for x in m.group(1).split(",") if x.strip()}
            prev = out.get(line, set())
            out[line] = None if prev is None else (prev | names)
    return out


def suppressed(table: dict[int, set[str] | None], lines: list[int], check_id: str, category: str) -> bool:
    for ln in lines:
        for at in (ln, ln - 1):
            if at in table:
                names = table[at]
                if names is None or check_id.upper() in names or category.upper() in names:
                    return True
    return False
