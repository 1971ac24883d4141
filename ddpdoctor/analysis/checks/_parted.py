"""Same op, different call sites: where the ranks parted before their sequences diverged.

A framework issues its own collectives (Lightning's barriers around ``setup``). A user's extra
barrier under ``if self.trainer.is_global_zero:`` pairs with the framework's barrier on the other
ranks: the ops still agree there, and the sequences only diverge later, between two of the
framework's calls, far from the user's line. So, when a group diverges, the positions just before
are compared by call site: the latest one where the ranks' matched calls come from different
sites and exactly one side's call is under a rank-dependent branch the other's is not
(``verdict.blame.conditioned_side``) is where the ranks parted.
"""

from __future__ import annotations

from ...verdict import blame, parting
from ..load import BLOCK, read_group_events
from .base import Context

#: How many positions before a divergence are compared.
WINDOW = 64


def _reader(ctx: Context, group: str):
    """``event(rank, seq)``: a rank's sequence event at a position of ``group`` (blocks cached)."""
    cache: dict[tuple[int, int], list[dict]] = {}

    def event(r: int, s: int) -> dict | None:
        rt = ctx.run.ranks.get(r)
        gs = rt.groups.get(group) if rt is not None else None
        b = (s - 1) // BLOCK
        if gs is None or s < 1 or b >= len(gs.blocks):
            return None
        if (r, b) not in cache:
            cache[(r, b)] = read_group_events(rt.path, group, gs.blocks[b][2], BLOCK)
        evs = cache[(r, b)]
        i = (s - 1) % BLOCK
        return evs[i] if i < len(evs) else None

    return event


def previous_sites(ctx: Context, group: str, point) -> dict[int, dict]:
    """rank -> the site of its call just before ``point`` (where the ranks still agreed)."""
    event = _reader(ctx, group)
    out = {}
    for r in point.events:
        ev = event(r, point.seq - 1)
        if ev is not None:
            out[r] = ctx.site(r, ev.get("site"))
    return out


def _site_key(site: dict) -> tuple:
    return tuple(tuple(f[:3]) for f in site.get("stack") or []) or (site.get("file"), site.get("line"))


def parted_before(ctx: Context, group: str, point) -> dict | None:
    """``{"seq", "sides": {key: ranks}, "sites": {key: site}, "events": {rank: event},
    "culprit": ranks, "branch": parting.Branch}`` for the latest position before ``point`` where
    matched calls came from different call sites, one side under a rank-dependent branch; None
    when there is none (within ``WINDOW`` positions)."""
    members = sorted(point.events)
    if len(members) < 2:
        return None
    event = _reader(ctx, group)

    for s in range(point.seq - 1, max(0, point.seq - 1 - WINDOW), -1):
        at = {r: event(r, s) for r in members}
        if any(e is None for e in at.values()) or len({e.get("op") for e in at.values()}) != 1:
            return None
        sides: dict[tuple, list[int]] = {}
        sites: dict[tuple, dict] = {}
        for r, ev in at.items():
            site = ctx.site(r, ev.get("site"))
            key = _site_key(site)
            sides.setdefault(key, []).append(r)
            sites.setdefault(key, site)
        if len(sides) < 2:
            continue
        flagged = blame.conditioned_side(sites)
        if flagged is None:
            continue
        found = parting.branches(sites[flagged], [v for k, v in sites.items() if k != flagged])
        return {"seq": s, "sides": sides, "sites": sites, "events": at, "culprit": sorted(sides[flagged]),
                "branch": parting.deciding(found), "flagged": flagged}
    return None
