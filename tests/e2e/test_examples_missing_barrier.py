"""End to end: the `checks/` example programs of missing-barrier under `ddpdoctor trace`, on real gloo
jobs (the unit tests on hand-written traces are in tests/unit)."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.jobs import ROOT, example_reports

EXAMPLES = ROOT / "checks" / "missing-barrier"


def line_of(path: Path, marker: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if marker in line)


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return example_reports(tmp_path_factory, "missing-barrier", failing=(), pg_timeout=None)


def test_bad_example_is_found(reports):
    mine = [x for x in reports["bad"] if x["category"] == "missing-barrier"]
    assert len(mine) == 1 and mine[0]["severity"] == "error" and mine[0]["ranks"] == [0, 1]
    bad = EXAMPLES / "bad.py"
    locs = {(loc["role"], loc["rank"], loc["line"]) for loc in mine[0]["locations"]}
    assert locs == {("write", 0, line_of(bad, "# the write")), ("read", 1, line_of(bad, "# ... and the read")),
                    ("check", 1, line_of(bad, "while not os.path.exists(path)"))}  # the poll: an existence check


def test_good_example_is_silent(reports):
    assert [x["id"] for x in reports["good"] if x["category"] == "missing-barrier"
            or x["severity"] == "error"] == []
