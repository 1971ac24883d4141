"""Helpers shared by tests/unit and tests/e2e: ``jobs`` (run real multi-rank jobs, bounded, and
check they report no internal error), ``traces`` (the one builder of hand-written trace folders),
``timeline_runs`` (traced runs shared by the timeline and HTML tests)."""
