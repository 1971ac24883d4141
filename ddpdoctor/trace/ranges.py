"""Compact rank lists: [0, 1, 2, 5] -> "0-2,5", so 256 ranks never print 256 lines."""

from __future__ import annotations


def fmt_ranks(ranks) -> str:
    rs = sorted(set(int(r) for r in ranks))
    if not rs:
        return "-"
    parts: list[str] = []
    start = prev = rs[0]
    for r in rs[1:]:
        if r == prev + 1:
            prev = r
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = r
    parts.append(str(start) if start == prev else f"{start}-{prev}")
    return ",".join(parts)
