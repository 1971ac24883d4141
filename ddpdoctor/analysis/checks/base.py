"""Base class of checks and the context they share (the run, alignment results, helpers).

A check is a :class:`Check` subclass in a module of this package named after its category
(``rank_failed.py`` for ``rank-failed``). Its class attributes are validated when the class is
created: an id ``DDnnn`` used by no other check, a kebab-case category, a severity, a title and a
fix. A check that reports variants with their own title/fix/severity declares them in ``kinds``
and passes ``kind=`` to :meth:`Check.finding`. A check that reports the root cause of a divergence
says so in :meth:`Check.explains`; divergent-collectives then stays quiet about it.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import re
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, ClassVar, TypeVar

from ddpdoctor.trace.ranges import fmt_ranks
from ddpdoctor.verdict import parting

from .. import align
from ..findings import SEVERITIES, Finding, Location
from ..run import Run

T = TypeVar("T")

_ID = re.compile(r"^DD\d{3}$")
_CATEGORY = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")
#: id -> check class, filled as check classes are created.
REGISTRY: dict[str, type[Check]] = {}


class CheckDefinitionError(TypeError):
    """A check class that breaks the Check API (bad or duplicate id, missing title...)."""


@dataclass(frozen=True)
class Kind:
    """A variant of a check's finding with its own title, fix and/or severity."""

    title: str | None = None
    fix: str | None = None
    severity: str | None = None


@dataclass
class Divergence:
    """The first position where a group's ranks issued different calls: ``by_op`` maps each op
    (None: no call) to the ranks that issued it; ``stopped`` are the ranks with no call."""

    group: str
    point: Any  # align.Point
    by_op: dict
    stopped: list[int]


class Check:
    """One check. Subclasses set the class attributes below and implement :meth:`run`."""

    id: ClassVar[str] = "DD000"
    category: ClassVar[str] = "none"
    severity: ClassVar[str] = "error"
    title: ClassVar[str] = ""
    fix: ClassVar[str] = ""
    #: Declared variants (name -> Kind) for ``finding(kind=...)``.
    kinds: ClassVar[dict[str, Kind]] = {}
    #: True for an intermediate base class that is no check itself.
    abstract: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("abstract", False):
            return
        problems = []
        if not _ID.match(str(cls.id)):
            problems.append(f"id {cls.id!r} is not DDnnn")
        if not _CATEGORY.match(str(cls.category)) or cls.category == "none":
            problems.append(f"category {cls.category!r} is not a kebab-case name")
        for name, sev in [("severity", cls.severity)] + [(f"kind {k!r}", v.severity) for k, v in cls.kinds.items()]:
            if sev is not None and sev not in SEVERITIES:
                problems.append(f"{name}: severity {sev!r} is not one of {', '.join(SEVERITIES)}")
        if not cls.title or not cls.fix:
            problems.append("title and fix are required")
        if "run" not in {k for c in cls.__mro__ if c is not Check for k in vars(c)}:
            problems.append("run(ctx) is not implemented")
        other = REGISTRY.get(cls.id)
        if other is not None and f"{other.__module__}.{other.__qualname__}" != f"{cls.__module__}.{cls.__qualname__}":
            problems.append(f"id {cls.id} is already used by {other.__module__}.{other.__qualname__}")
        if problems:
            raise CheckDefinitionError(f"check {cls.__module__}.{cls.__qualname__}: " + "; ".join(problems))
        REGISTRY[cls.id] = cls

    def run(self, ctx: Context) -> list[Finding]:
        raise NotImplementedError

    def explains(self, ctx: Context, divergence: Divergence) -> bool:
        """Whether this check reports the root cause of ``divergence`` (so divergent-collectives
        need not). Asked only of the checks that run in this report."""
        return False

    def finding(self, message: str, ranks, locations=(), severity: str | None = None,
                fix: str | None = None, title: str | None = None, evidence=(), data=None,
                kind: str | None = None) -> Finding:
        if kind is not None:
            if kind not in self.kinds:
                raise KeyError(f"{self.id}: undeclared finding kind {kind!r}")
            k = self.kinds[kind]
            severity = severity or k.severity
            title = title or k.title
            fix = fix if fix is not None else k.fix
        return Finding(id=self.id, category=self.category, severity=severity or self.severity,
                       title=title or self.title, message=message, ranks=sorted(set(ranks)),
                       locations=list(locations), fix=fix if fix is not None else self.fix,
                       evidence=[list(e) for e in evidence], data=data or {})


class Context:
    """Shared, lazily computed views of a run, computed once per report whichever check asks
    first: the groups, their first divergence and metadata mismatches (cached properties), and
    the analyses one check computes for several (:meth:`shared`: failures, p2p channels, uneven
    DDP steps)."""

    def __init__(self, run: Run) -> None:
        self.run = run
        #: Ids of the checks this report runs (None: all); lets a check leave a case to another.
        self.selected: set[str] | None = None
        self._shared: dict[str, Any] = {}

    def enabled(self, check_id: str) -> bool:
        """Whether check ``check_id`` runs in this report."""
        return self.selected is None or check_id in self.selected

    def shared(self, name: str, compute: Callable[[Context], T]) -> T:
        """``compute(self)``, computed once per context under ``name``."""
        if name not in self._shared:
            self._shared[name] = compute(self)
        return self._shared[name]

    @cached_property
    def checks(self) -> list[Check]:
        """The checks this report runs, by id."""
        return [c for c in all_checks() if self.enabled(c.id)]

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

    def split_conditions(self, rank: int, sid, other: list[tuple[int, object]],
                         before: list | None = None) -> list[Location]:
        """Branch headers enclosing this rank's call that the other ranks' calls are not under,
        where their stacks parted (``verdict.parting``); role ``condition`` for a rank-dependent
        one (first), ``branch`` otherwise. ``before``: the sites of the other ranks' previous calls."""
        found = parting.branches(self.site(rank, sid), [self.site(r, osid) for r, osid in other],
                                 before or ())
        out = [Location(rank, b.file, b.line, "", b.text, "condition" if b.rank_dependent else "branch")
               for b in found]
        out.sort(key=lambda loc: loc.role != "condition")
        return out


def fmt(ranks) -> str:
    rs = sorted(set(ranks))
    return ("rank " if len(rs) == 1 else "ranks ") + fmt_ranks(rs)


def all_checks() -> list[Check]:
    """One instance of every check of this package (each module but ``base`` and ``_*``), by id."""
    package = __name__.rsplit(".", 1)[0]
    classes: dict[str, type] = {}
    for mod in pkgutil.iter_modules(importlib.import_module(package).__path__):
        if mod.name == "base" or mod.name.startswith("_"):
            continue
        module = importlib.import_module(f"{package}.{mod.name}")
        for obj in vars(module).values():
            if isinstance(obj, type) and issubclass(obj, Check) and obj is not Check \
                    and obj.__module__ == module.__name__ and not obj.__dict__.get("abstract", False):
                classes[obj.id] = obj
    return [classes[k]() for k in sorted(classes)]
