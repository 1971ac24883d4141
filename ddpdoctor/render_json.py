"""``--format json``: a versioned document (see docs/report-format.md)."""

from __future__ import annotations

import json

from .findings import Finding
from .run import Run

REPORT_SCHEMA = "ddpdoctor.report/1"


def render(run: Run, findings: list[Finding], notes: list[str]) -> str:
    rt0 = next(iter(run.ranks.values()))
    doc = {
        "schema": REPORT_SCHEMA,
        "run": {"id": run.run_id, "attempt": run.attempt, "world_size": run.world,
                "backend": run.backend, "torch": rt0.header.get("torch"),
                "ranks_found": sorted(run.ranks), "ranks_missing": run.missing,
                "duration_s": round(run.duration_s(), 3), "notes": notes + run.notes},
        "findings": [f.to_json() for f in findings],
    }
    return json.dumps(doc, indent=2, default=str)
