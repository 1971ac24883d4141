"""One finding per site: the same finding repeated per call is shown once, with a count.

A check compares records call by call (the n-th seed at a line on every rank...). A program that
makes the same call thousands of times (a dataset that seeds per item) would otherwise print the
same finding thousands of times. Findings of one check with the same title, severity and
locations are one finding: the first is kept, the ranks are merged, the count is in the message
and in ``data["repeats"]``.
"""

from __future__ import annotations

from .findings import Finding


def _key(f: Finding) -> tuple:
    return (f.id, f.severity, f.title, tuple((loc.file, loc.line, loc.role) for loc in f.locations))


def group_repeats(findings: list[Finding]) -> list[Finding]:
    """``findings`` with repeats folded into their first occurrence (order kept)."""
    first: dict[tuple, Finding] = {}
    counts: dict[tuple, int] = {}
    out: list[Finding] = []
    for f in findings:
        if not f.locations:  # nothing says two of them are the same site
            out.append(f)
            continue
        k = _key(f)
        if k in first:
            counts[k] += 1
            kept = first[k]
            kept.ranks = sorted(set(kept.ranks) | set(f.ranks))
            continue
        first[k] = f
        counts[k] = 1
        out.append(f)
    for k, f in first.items():
        n = counts[k]
        if n > 1:
            f.message += f" (The same finding {n} times at this site, once per call; shown once.)"
            f.data = dict(f.data, repeats=n)
    return out
