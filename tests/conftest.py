"""pytest set-up shared by tests/unit and tests/e2e. The helpers live in tests/support/ (this
folder is on sys.path, so tests import ``support.jobs``, ``support.traces``); the job helpers are
re-exported here for tests that import them from ``conftest``."""

from __future__ import annotations

import pytest
from support.jobs import (  # noqa: F401 - re-exported
    PY,
    ROOT,
    RUN_TIMEOUT,
    example_reports,
    findings_json,
    free_port,
    kill_tree,
    read_records,
    report,
    run_bounded,
    torchrun,
    trace,
)


@pytest.fixture
def tmp_trace(tmp_path):
    return tmp_path / "trace"
