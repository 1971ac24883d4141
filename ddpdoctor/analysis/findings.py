"""What checks produce: findings with ranks, source locations and a fix."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

SEVERITIES = ("error", "warning", "info")
SEVERITY_RANK = {s: i for i, s in enumerate(SEVERITIES)}


@dataclass
class Location:
    rank: int
    file: str
    line: int
    function: str = ""
    source: str = ""
    role: str = "call"  # call | condition | write | read | exception | ...

    def short(self) -> str:
        import os

        return f"{os.path.basename(self.file)}:{self.line}"


@dataclass
class Finding:
    id: str
    category: str
    severity: str
    title: str
    message: str
    ranks: list[int]
    locations: list[Location] = field(default_factory=list)
    fix: str = ""
    evidence: list[list] = field(default_factory=list)  # rows for --verbose: [rank(s), what, where]
    data: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        d = asdict(self)
        d["locations"] = [{"rank": loc.rank, "file": loc.file, "line": loc.line,
                           "function": loc.function, "source": loc.source, "role": loc.role}
                          for loc in self.locations]
        return d


def sort_key(f: Finding):
    """Report order: severity (errors first), then check id, category, first rank."""
    return (SEVERITY_RANK.get(f.severity, 9), f.id, f.category, min(f.ranks or [0]))
