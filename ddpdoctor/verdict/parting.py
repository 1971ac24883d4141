"""Where the ranks' control flow parted, from what the ranks did: their recorded call stacks.

Two ranks that issued different calls (or the same op from different lines) ran the same code
until some frame, where one went one way and the other another. Comparing their stacks
(outermost first) finds that frame; the branches there (``if``/``while``/``for`` headers from the
file's ``ast``, so comments never count) that enclose one rank's line and not the other's are
where they parted: *observed* branches, one rank inside, the other outside. Below that frame
(one rank went deeper into user code, the other did not: a framework called a user hook on one
rank only) every branch around the deeper rank's call is a *candidate*: whether it parted the
ranks is judged by the rank-dependence analysis shared with ``ddpdoctor lint``
(:mod:`ddpdoctor.verdict.rankdep`).

Sites are ``site`` records (``stack``: ``[file, line, func, src]`` innermost first; ``conds``: the
headers recorded with them, used when the source file cannot be read any more).
"""

from __future__ import annotations

import linecache
from dataclasses import dataclass
from typing import Mapping, Sequence

from ..trace import sourceinfo
from . import rankdep

IF_KINDS = ("if", "if-else")
LOOP_KINDS = ("for", "while", "asyncfor")


@dataclass(frozen=True)
class Branch:
    """A branch header one side's call is under and another side's is not."""

    file: str
    line: int
    text: str
    kind: str
    #: True: both calls are in the same frame, this one inside the branch, the other outside.
    observed: bool

    @property
    def judgement(self) -> rankdep.Judgement:
        return rankdep.judge(self.file, self.line, self.text)

    @property
    def rank_dependent(self) -> bool:
        """Whether this branch parted the ranks: they were seen to go different ways at this
        ``if`` (one inside, the other outside, in the same frame), or the analysis says its
        condition is rank-dependent."""
        return (self.observed and self.kind in IF_KINDS) or self.judgement.state == "yes"

    def cond(self) -> list:
        """As a recorded ``conds`` entry: ``[file, line, text, kind]``."""
        return [self.file, self.line, self.text, self.kind]


def _frames(site: Mapping | None) -> list[tuple[str, int, str]]:
    """The user frames of a site, outermost first: ``(file, line, func)``."""
    return [fr[:3] for fr in _frames_src(site)]


def _frames_src(site: Mapping | None) -> list[tuple[str, int, str, str]]:
    """``_frames`` with each frame's recorded source line."""
    if not site:
        return []
    stack = site.get("stack") or []
    if not stack and site.get("file"):
        stack = [[site.get("file"), site.get("line", 0), site.get("func", "")]]
    out = []
    for fr in reversed(stack):
        if isinstance(fr, (list, tuple)) and len(fr) >= 3:
            try:
                out.append((str(fr[0]), int(fr[1]), str(fr[2]), str(fr[3]) if len(fr) > 3 else ""))
            except (TypeError, ValueError):
                continue
    return out


def _align(a: list, b: list) -> tuple[int, int] | None:
    """Indexes of the outermost frame the two stacks share (same file, function; the line may
    differ), tolerating stacks cut at different depths."""
    for n in range(len(a) + len(b)):
        for i in range(max(0, n - len(b) + 1), min(n, len(a) - 1) + 1):
            j = n - i
            if a[i][0] == b[j][0] and a[i][2] == b[j][2]:
                return i, j
    return None


def _enclosing(file: str, line: int, src: str = "") -> list[list] | None:
    """Branch headers around ``file:line`` (``[line, text, kind]``), None when the file cannot be
    read or was edited since the run (its line is no longer the recorded source)."""
    if not linecache.getlines(file):
        return None
    if src and linecache.getline(file, line).strip() != src.strip():
        return None
    return sourceinfo.enclosing(file, line)


def _recorded(site: Mapping | None, file: str) -> list[list]:
    return [c for c in (site or {}).get("conds") or [] if len(c) >= 4 and c[0] == file]


def _pair(mine: Mapping, theirs: Mapping) -> list[Branch]:
    """Branches ``mine``'s call is under that ``theirs``' is not, innermost first."""
    srcs = {(f, ln): src for f, ln, _fn, src in _frames_src(mine) + _frames_src(theirs)}
    a, b = _frames(mine), _frames(theirs)
    if not a:
        return []
    at = _align(a, b)
    out: list[Branch] = []
    start = 0
    if at is not None:
        i, j = at
        while i < len(a) and j < len(b) and a[i] == b[j]:
            i, j = i + 1, j + 1
        start = i
        if i < len(a) and j < len(b) and a[i][0] == b[j][0] and a[i][2] == b[j][2]:
            # The parting frame: same function, different lines.
            file, la, lb = a[i][0], a[i][1], b[j][1]
            ours, other = _enclosing(file, la, srcs.get((file, la), "")), \
                _enclosing(file, lb, srcs.get((file, lb), ""))
            if ours is None or other is None:  # source gone: the headers recorded with the sites
                theirs_lines = {int(c[1]) for c in _recorded(theirs, file)}
                ours = [[int(c[1]), c[2], c[3]] for c in _recorded(mine, file)]
                other = [[ln, "", ""] for ln in theirs_lines]
            other_lines = {c[0] for c in other}
            for ln, text, kind in reversed(ours):
                if ln not in other_lines:
                    out.append(Branch(file, int(ln), text, kind, True))
            start = i + 1
    # Deeper frames of mine only: every branch there is a candidate (outermost first here).
    deeper: list[Branch] = []
    for file, line, _func in a[start:]:
        found = _enclosing(file, line, srcs.get((file, line), ""))
        if found is None:
            found = [[int(c[1]), c[2], c[3]] for c in _recorded(mine, file)]
        deeper.extend(Branch(file, int(ln), text, kind, False) for ln, text, kind in found)
    return deeper[::-1] + out


def branches(mine: Mapping | None, others: Sequence[Mapping | None],
             before: Sequence[Mapping | None] = ()) -> list[Branch]:
    """The branches ``mine``'s call is under and none of ``others``' calls is, innermost first
    (observed ones from the parting frame, candidates from deeper frames). With no other call to
    compare with (the other ranks made none), every branch around ``mine`` is a candidate.

    ``before``: the sites of the other ranks' previous calls (the last ones they completed). A
    candidate the other ranks' previous call was outside of, in the same frame, is observed too:
    they were there, and their next call is not under it (they skipped or left it)."""
    if not mine:
        return []
    if all(o is None for o in others):
        result: list[Branch] | None = _pair(mine, {})
    else:
        result = None
        for other in others:
            if other is None:
                continue
            found = _pair(mine, other)
            if result is None:
                result = found
            else:
                keep = {(b.file, b.line) for b in found}
                result = [b for b in result if (b.file, b.line) in keep]
    result = result or []
    prev = [p for p in before if p]
    if prev and any(not b.observed for b in result):
        seen = None
        for p in prev:
            obs = {(b.file, b.line) for b in _pair(mine, p) if b.observed}
            seen = obs if seen is None else seen & obs
        result = [Branch(b.file, b.line, b.text, b.kind, True) if (b.file, b.line) in (seen or set()) else b
                  for b in result]
    return result


def deciding(found: Sequence[Branch]) -> Branch | None:
    """The branch that parted the ranks: the innermost one whose condition the analysis finds
    rank-dependent, else the innermost ``if`` they were seen to part at, else None."""
    for b in found:
        if b.judgement.state == "yes":
            return b
    for b in found:
        if b.rank_dependent:
            return b
    return None
