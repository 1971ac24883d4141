"""Building static findings: the trace checks' Finding type, marked ``source: static``."""

from __future__ import annotations

from ..analysis.findings import Finding, Location
from ..source.units import Module
from .catalog import category, title

#: Static findings have no rank: their locations carry this rank number.
NO_RANK = -1


def loc(module: Module, line: int, role: str, function: str = "") -> Location:
    return Location(NO_RANK, module.display, int(line), function, module.line(line), role)


def make(check_id: str, severity: str, message: str, locations: list[Location], fix: str = "",
         data: dict | None = None, title_text: str | None = None) -> Finding:
    """A Finding whose first location is the primary one (the line a SARIF viewer marks)."""
    d = {"source": "static"}
    d.update(data or {})
    return Finding(id=check_id, category=category(check_id), severity=severity,
                   title=title_text or title(check_id), message=message, ranks=[], locations=locations,
                   fix=fix, data=d)
