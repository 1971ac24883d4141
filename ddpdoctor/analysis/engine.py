"""The one pipeline: trace folders -> run -> findings -> exit code (:func:`analyze_paths`).

Every check that is selected runs on one shared context; a check that breaks is reported as a
note, not fatal. The command line, ``ddpdoctor.check()``/``spawn()`` and the timeline use it."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import EXIT_FINDINGS, EXIT_OK, SelectionError
from . import frmodel
from .checks import Check, Context, all_checks
from .findings import SEVERITY_RANK, Finding, sort_key
from .grouping import group_repeats
from .run import Run, load_run


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
    findings = group_repeats(findings)
    findings.sort(key=sort_key)
    if frmodel.is_fr(run):  # say that they come from Flight Recorder dumps, and what those cannot show
        frmodel.annotate_findings(run, findings)
    return findings, notes


def failing(findings: list[Finding], fail_on: str) -> list[Finding]:
    """The findings at least as severe as ``fail_on`` (error|warning|info; none for never)."""
    if fail_on == "never":
        return []
    limit = SEVERITY_RANK[fail_on]
    return [f for f in findings if SEVERITY_RANK.get(f.severity, 9) <= limit]


def exit_code(findings: list[Finding], fail_on: str) -> int:
    """EXIT_FINDINGS when a finding is at least as severe as ``fail_on``, else EXIT_OK."""
    return EXIT_FINDINGS if failing(findings, fail_on) else EXIT_OK


@dataclass
class Analysis:
    """What :func:`analyze_paths` found: the run, its findings (report order), notes about checks
    that could not run, and the exit code for ``fail_on``."""

    run: Run
    findings: list[Finding]
    notes: list[str] = field(default_factory=list)
    fail_on: str = "error"

    @property
    def exit_code(self) -> int:
        return exit_code(self.findings, self.fail_on)

    @property
    def failing(self) -> list[Finding]:
        """The findings at or above ``fail_on``."""
        return failing(self.findings, self.fail_on)


def analyze_paths(paths: list[str], select=None, ignore=None, run_id: str | None = None,
                  fail_on: str = "error") -> Analysis:
    """Load the run in ``paths`` (trace folders or files) and run the selected checks.

    Raises SelectionError for an unknown check name (before reading anything, so that a typo is a
    usage error, not a clean report) and TraceError for unusable input."""
    if fail_on != "never" and fail_on not in SEVERITY_RANK:
        raise ValueError(f"fail_on must be error, warning, info or never, not {fail_on!r}")
    select_checks(select, ignore)
    return analyze_run(load_run(list(paths), run_id=run_id), select, ignore, fail_on)


def analyze_run(run: Run, select=None, ignore=None, fail_on: str = "error") -> Analysis:
    """The selected checks over a loaded run."""
    findings, notes = analyze(run, select, ignore)
    return Analysis(run, findings, notes, fail_on)
