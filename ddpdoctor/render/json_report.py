"""``--format json``: a versioned document (see docs/report-format.md).

The document is one JSON object; ``schema`` names its version. Fields are only ever added
within a version: consumers must ignore keys they do not know.
"""

from __future__ import annotations

import json

from ..analysis.findings import SEVERITIES, Finding
from ..analysis.run import Run

REPORT_SCHEMA = "ddpdoctor.report/1"


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("ddpdoctor")
    except Exception:
        return "?"


def document(run: Run, findings: list[Finding], notes: list[str]) -> dict:
    """The report as plain data (what ``render`` serialises)."""
    rt0 = next(iter(run.ranks.values()))
    summary = {s: 0 for s in SEVERITIES}
    for f in findings:
        summary[f.severity] = summary.get(f.severity, 0) + 1
    return {
        "schema": REPORT_SCHEMA,
        "tool": {"name": "ddpdoctor", "version": _version()},
        "run": {"id": run.run_id, "attempt": run.attempt, "world_size": run.world,
                "backend": run.backend, "torch": rt0.header.get("torch"),
                "ranks_found": sorted(run.ranks), "ranks_missing": run.missing,
                "duration_s": round(run.duration_s(), 3), "notes": run.notes + notes},
        "summary": summary,
        "findings": [f.to_json() for f in findings],
    }


def render(run: Run, findings: list[Finding], notes: list[str]) -> str:
    return json.dumps(document(run, findings, notes), indent=2, default=str)
