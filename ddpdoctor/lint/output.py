"""Text and JSON output of ``ddpdoctor lint``."""

from __future__ import annotations

import json
import textwrap

from ..analysis.findings import SEVERITIES
from .engine import LintResult

LINT_SCHEMA = "ddpdoctor.lint/1"
_MARK = {"error": "ERROR", "warning": "WARNING", "info": "info"}
WIDTH = 100


def tool_version() -> str:
    """The installed ddpdoctor's version ("?" when unknown); importlib.metadata is imported only
    here, when output is rendered, because it is slow to import."""
    try:
        from importlib.metadata import version

        return version("ddpdoctor")
    except Exception:
        return "?"


def summary(result: LintResult) -> dict:
    out = {s: 0 for s in SEVERITIES}
    for f in result.findings:
        out[f.severity] = out.get(f.severity, 0) + 1
    return out


def document(result: LintResult) -> dict:
    """The JSON document: ``schema``, ``tool``, ``summary`` and ``findings`` as in the report's
    document (docs/report-format.md); ``lint`` replaces ``run``; every finding has
    ``"source": "static"``."""
    findings = []
    for f in result.findings:
        d = f.to_json()
        d["source"] = "static"
        findings.append(d)
    return {
        "schema": LINT_SCHEMA,
        "tool": {"name": "ddpdoctor", "version": tool_version()},
        "source": "static",
        "lint": {"files": len(result.files), "lines": result.lines, "suppressed": result.suppressed,
                 "seconds": round(result.seconds, 3), "notes": result.notes},
        "summary": summary(result),
        "findings": findings,
    }


def render_json(result: LintResult) -> str:
    return json.dumps(document(result), indent=2, default=str)


def render_text(result: LintResult, verbose: bool = False) -> str:
    out = []
    for n in result.notes:
        out.append(f"note: {n}")
    for f in result.findings:
        p = f.locations[0] if f.locations else None
        where = f"{p.file}:{p.line}" if p else "?"
        out.append(f"{where}: {_MARK.get(f.severity, f.severity)} {f.id} {f.category} — {f.title}")
        out.extend(textwrap.wrap(f.message, WIDTH, initial_indent="    ", subsequent_indent="    "))
        for loc in f.locations[1:] if not verbose else f.locations:
            src = f"  `{loc.source}`" if loc.source else ""
            out.append(f"    {loc.role} at {loc.file}:{loc.line}{src}")
        if f.fix:
            out.extend(textwrap.wrap("fix: " + f.fix, WIDTH, initial_indent="    ", subsequent_indent="         "))
        out.append("")
    s = summary(result)
    counts = ", ".join(f"{n} {k}{'s' if n != 1 else ''}" for k, n in s.items() if n)
    tail = f"{len(result.files)} file(s), {result.lines} lines"
    if result.suppressed:
        tail += f", {result.suppressed} suppressed"
    out.append(f"Findings: {counts} ({tail})" if result.findings else f"No findings ({tail}).")
    return "\n".join(out)
