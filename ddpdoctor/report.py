"""From a run to findings: run every selected check; a check that breaks is reported, not fatal."""

from __future__ import annotations

from .checks import Check, Context, all_checks
from .findings import SEVERITY_RANK, Finding
from .run import Run


class SelectionError(ValueError):
    """--select/--ignore named a check that does not exist."""


def select_checks(select: list[str] | None = None, ignore: list[str] | None = None) -> list[Check]:
    """The checks to run: ``select`` (ids or categories; all when empty) minus ``ignore``.

    Raises SelectionError for a name that is neither a check id nor a category, so that a typo
    never silently turns a check off."""
    checks = all_checks()
    known = {c.id.upper() for c in checks} | {c.category.lower() for c in checks}
    for name in list(select or []) + list(ignore or []):
        n = name.strip()
        if n and n.upper() not in known and n.lower() not in known:
            raise SelectionError(
                f"unknown check {n!r}; known: " + ", ".join(f"{c.id} ({c.category})" for c in checks))

    def match(c: Check, names) -> bool:
        want = {n.strip().upper() for n in names} | {n.strip().lower() for n in names}
        return c.id.upper() in want or c.category.lower() in want

    if select:
        checks = [c for c in checks if match(c, select)]
    if ignore:
        checks = [c for c in checks if not match(c, ignore)]
    return checks


def sort_key(f: Finding):
    """Report order: severity (errors first), then check id, category, first rank."""
    return (SEVERITY_RANK.get(f.severity, 9), f.id, f.category, min(f.ranks or [0]))


def analyze(run: Run, select=None, ignore=None) -> tuple[list[Finding], list[str]]:
    """Findings sorted by severity and id, plus one-line notes about checks that could not run."""
    checks = select_checks(select, ignore)
    ctx = Context(run)
    ctx.selected = {c.id for c in checks}
    findings: list[Finding] = []
    notes: list[str] = []
    for check in checks:
        try:
            findings.extend(check.run(ctx))
        except Exception as exc:  # one broken check must not hide the others' findings
            notes.append(f"check {check.id} ({check.category}) failed: {type(exc).__name__}: {exc}")
    findings.sort(key=sort_key)
    from . import frmodel

    if frmodel.is_fr(run):
        frmodel.annotate_findings(run, findings)
    return findings, notes


def exit_code(findings: list[Finding], fail_on: str) -> int:
    """1 when a finding is at least as severe as ``fail_on`` (error|warning|info), else 0."""
    if fail_on == "never":
        return 0
    limit = SEVERITY_RANK[fail_on]
    return 1 if any(SEVERITY_RANK.get(f.severity, 9) <= limit for f in findings) else 0
