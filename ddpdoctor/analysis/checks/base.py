"""Base class of checks and the context they share (the run, alignment results, helpers)."""

from __future__ import annotations

import os
from functools import cached_property

from ddpdoctor.trace.ranges import fmt_ranks
from ddpdoctor.trace.sourceinfo import is_rank_dependent

from .. import align
from ..findings import Finding, Location
from ..run import Run

DOCS_URL = "checks/{category}/README.md"




class Check:
    id = "DD000"
    category = "none"
    severity = "error"
    title = ""
    fix = ""

    def run(self, ctx: Context) -> list[Finding]:
        raise NotImplementedError

    def finding(self, message: str, ranks, locations=(), severity: str | None = None,
                fix: str | None = None, title: str | None = None, evidence=(), data=None) -> Finding:
        return Finding(id=self.id, category=self.category, severity=severity or self.severity,
                       title=title or self.title, message=message, ranks=sorted(set(ranks)),
                       locations=list(locations), fix=fix if fix is not None else self.fix,
                       evidence=[list(e) for e in evidence], data=data or {})


class Context:
    """Shared, lazily computed views of a run."""

    def __init__(self, run: Run) -> None:
        self.run = run
        #: Ids of the checks this report runs (None: all); lets a check leave a case to another.
        self.selected: set[str] | None = None

    def enabled(self, check_id: str) -> bool:
        """Whether check ``check_id`` runs in this report."""
        return self.selected is None or check_id in self.selected

    @cached_property
    def groups(self) -> list[str]:
        return align.all_groups(self.run)

    @cached_property
    def divergences(self) -> dict[str, align.Point]:
        out = {}
        for g in self.groups:
            p = align.first_divergence(self.run, g)
            if p is not None:
                out[g] = p
        return out

    @cached_property
    def mismatches(self) -> dict[str, list[align.Point]]:
        """Per group, the first positions (before any divergence) where the same op had
        different shapes, dtypes, reduce ops or roots."""
        out = {}
        for g in self.groups:
            until = self.divergences[g].seq if g in self.divergences else None
            points = align.mismatches(self.run, g, until, limit=3)
            if points:
                out[g] = points
        return out

    # -- helpers --------------------------------------------------------------------------------
    def site(self, rank: int, sid) -> dict:
        rt = self.run.ranks.get(rank)
        return rt.site(sid) if rt is not None else {"file": "?", "line": 0, "func": "?"}

    def loc(self, rank: int, sid, role: str = "call") -> Location:
        s = self.site(rank, sid)
        return Location(rank, s.get("file", "?"), int(s.get("line", 0) or 0), s.get("func", ""),
                        s.get("src", ""), role)

    def where(self, rank: int, sid) -> str:
        s = self.site(rank, sid)
        via = f" via {s['via']}" if s.get("via") else ""
        return f"{os.path.basename(str(s.get('file', '?')))}:{s.get('line', 0)} {s.get('func', '')}(){via}"

    def failed_ranks(self) -> dict[int, dict]:
        """Ranks that raised, or whose trace ends without an exit record (killed)."""
        out = {}
        for r, rt in self.run.ranks.items():
            ex = rt.exit_record()
            if ex is None:
                out[r] = {"how": "killed"}
            elif ex.get("how") in ("exception", "signal"):
                out[r] = ex
        return out

    def split_conditions(self, rank: int, sid, other: list[tuple[int, object]]) -> list[Location]:
        """Branch headers enclosing this rank's call that the other ranks' calls are not under."""
        mine = self.site(rank, sid).get("conds") or []
        theirs = set()
        for r, osid in other:
            for c in self.site(r, osid).get("conds") or []:
                theirs.add((c[0], c[1]))
        out = []
        for c in mine:
            if (c[0], c[1]) in theirs:
                continue
            out.append(Location(rank, c[0], int(c[1]), "", c[2],
                                "condition" if is_rank_dependent(c[2]) else "branch"))
        out.sort(key=lambda loc: loc.role != "condition")
        return out


def fmt(ranks) -> str:
    rs = sorted(set(ranks))
    return ("rank " if len(rs) == 1 else "ranks ") + fmt_ranks(rs)
