"""Helpers shared by the checks that compare rare records (seeds, splits, samplers, optimizers)
across ranks: the same record on every rank is found by its call site and occurrence, never by
position in the file (ranks interleave other records differently)."""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

from ...verdict import blame
from .base import Context, fmt


def site_key(ctx: Context, rank: int, sid) -> tuple:
    """(file, line) of a call site: comparable across ranks, unlike site ids."""
    s = ctx.site(rank, sid)
    return (s.get("file", "?"), int(s.get("line", 0) or 0))


def aligned(ctx: Context, kind: str, site_of: Callable[[dict], object] | None = None,
            records: Callable | None = None) -> dict[tuple, dict[int, dict]]:
    """``(file, line, n)`` -> {rank: record}: the n-th record of this kind from that line on
    each rank. ``site_of`` picks the site id to align on (default: the record's ``site``)."""
    out: dict[tuple, dict[int, dict]] = defaultdict(dict)
    for rank, rt in ctx.run.ranks.items():
        counts: dict[tuple, int] = defaultdict(int)
        for rec in (records(rt) if records else rt.records(kind)):
            sid = site_of(rec) if site_of else rec.get("site")
            sk = site_key(ctx, rank, sid)
            out[(sk[0], sk[1], counts[sk])][rank] = rec
            counts[sk] += 1
    return out


def by_value(per_rank: dict[int, object]) -> dict[object, list[int]]:
    """value -> ranks holding it, largest group first."""
    groups: dict[object, list[int]] = defaultdict(list)
    for r, v in sorted(per_rank.items()):
        groups[v].append(r)
    return dict(sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[1][0])))


def describe(groups: dict[object, list[int]], show: Callable[[object], str] = str, limit: int = 4) -> str:
    """"ranks 0-2: a; rank 3: b" (at most ``limit`` groups)."""
    parts = [f"{fmt(rs)}: {show(v)}" for v, rs in list(groups.items())[:limit]]
    if len(groups) > limit:
        parts.append(f"{len(groups) - limit} more distinct value(s)")
    return "; ".join(parts)


def minority(groups: dict[object, list[int]]) -> list[int]:
    """Ranks outside the largest group when it is strictly the largest, else all ranks."""
    found = blame.minority(groups)
    if found is not None:
        return found[1]
    return sorted(r for rs in groups.values() for r in rs)
