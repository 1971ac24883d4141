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

from array import array

from ...verdict import blame, parting
from ..load import BLOCK
from ..regroup import group_events as _group_events  # (offset, record) as load.iter_records reads
from ..regroup import group_lines
from .base import Context

#: How many positions before a divergence are compared.
WINDOW = 64


class _Window:
    """Each rank's calls at positions ``lo..hi`` of a group. Only the op and site of each are kept
    (a few bytes a call: this runs over every rank of the group), and the whole event is read
    again from its offset for the one position a finding shows."""

    def __init__(self, ctx: Context, group: str, lo: int, hi: int) -> None:
        self.ctx, self.group, self.lo, self.hi = ctx, group, max(1, lo), hi
        self._ranks: dict[int, tuple | None] = {}

    def _load(self, r: int) -> tuple | None:
        rt = self.ctx.run.ranks.get(r)
        gs = rt.groups.get(self.group) if rt is not None else None
        b = (self.lo - 1) // BLOCK
        if gs is None or b >= len(gs.blocks):
            return None
        ops: list = []
        sites: list = []
        offsets = array("q")
        s = b * BLOCK
        # op and site only: most lines are known by their shape, not decoded (regroup.py)
        for start, _raw, rec, _whole in group_lines(rt.path, self.group, gs.blocks[b][2]):
            s += 1
            if s < self.lo:
                continue
            if s > self.hi:
                break
            ops.append(rec.get("op"))
            sites.append(rec.get("site"))
            offsets.append(start)
        return ops, sites, offsets

    def _at(self, r: int, s: int) -> tuple | None:
        if r not in self._ranks:
            self._ranks[r] = self._load(r)
        got = self._ranks[r]
        i = s - self.lo
        if got is None or not self.lo <= s <= self.hi or i >= len(got[0]):
            return None
        return got[0][i], got[1][i], got[2][i]

    def call(self, r: int, s: int) -> tuple | None:
        """(op, site) of rank ``r``'s call at position ``s``; None when it has none there."""
        got = self._at(r, s)
        return None if got is None else got[:2]

    def event(self, r: int, s: int) -> dict | None:
        """The whole event at position ``s``, read again from the file."""
        got = self._at(r, s)
        if got is None:
            return None
        for _start, rec in _group_events(self.ctx.run.ranks[r].path, self.group, got[2]):
            return rec
        return None


def previous_sites(ctx: Context, group: str, point) -> dict[int, dict]:
    """rank -> the site of its call just before ``point`` (where the ranks still agreed)."""
    window = _Window(ctx, group, point.seq - 1, point.seq - 1)
    out = {}
    for r in point.events:
        call = window.call(r, point.seq - 1)
        if call is not None:
            out[r] = ctx.site(r, call[1])
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
    window = _Window(ctx, group, point.seq - WINDOW, point.seq - 1)

    for s in range(point.seq - 1, max(0, point.seq - 1 - WINDOW), -1):
        at = {r: window.call(r, s) for r in members}
        if any(e is None for e in at.values()) or len({e[0] for e in at.values()}) != 1:
            return None
        sides: dict[tuple, list[int]] = {}
        sites: dict[tuple, dict] = {}
        for r, (_op, sid) in at.items():
            site = ctx.site(r, sid)
            key = _site_key(site)
            sides.setdefault(key, []).append(r)
            sites.setdefault(key, site)
        if len(sides) < 2:
            continue
        flagged = blame.conditioned_side(sites)
        if flagged is None:
            continue
        found = parting.branches(sites[flagged], [v for k, v in sites.items() if k != flagged])
        events = {r: window.event(r, s) for r in members}
        return {"seq": s, "sides": sides, "sites": sites, "events": events, "culprit": sorted(sides[flagged]),
                "branch": parting.deciding(found), "flagged": flagged}
    return None
