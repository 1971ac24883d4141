"""From a run to findings: run every selected check; a check that breaks is reported, not fatal."""

from __future__ import annotations

from .checks import Context, all_checks
from .findings import SEVERITY_RANK, Finding, sort_key
from .run import Run


def select_checks(select: list[str] | None = None, ignore: list[str] | None = None):
    checks = all_checks()
    if select:
        want = {s.strip() for s in select}
        checks = [c for c in checks if c.id in want or c.category in want]
    if ignore:
        drop = {s.strip() for s in ignore}
        checks = [c for c in checks if c.id not in drop and c.category not in drop]
    return checks


def analyze(run: Run, select=None, ignore=None) -> tuple[list[Finding], list[str]]:
    """Findings sorted by severity, plus one-line notes about checks that could not run."""
    ctx = Context(run)
    findings: list[Finding] = []
    notes: list[str] = []
    for check in select_checks(select, ignore):
        try:
            findings.extend(check.run(ctx))
        except Exception as exc:  # one broken check must not hide the others' findings
            notes.append(f"check {check.id} ({check.category}) failed: {type(exc).__name__}: {exc}")
    findings.sort(key=sort_key)
    return findings, notes


def exit_code(findings: list[Finding], fail_on: str) -> int:
    if fail_on == "never":
        return 0
    limit = SEVERITY_RANK[fail_on]
    return 1 if any(SEVERITY_RANK.get(f.severity, 9) <= limit for f in findings) else 0
