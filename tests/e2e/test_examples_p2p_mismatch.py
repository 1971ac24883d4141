"""End to end: the `checks/` example programs of p2p-mismatch under `ddpdoctor trace`, on real gloo
jobs (the unit tests on hand-written traces are in tests/unit)."""

from __future__ import annotations

import pytest
from support.jobs import example_reports


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return example_reports(tmp_path_factory, "p2p-mismatch", pg_timeout="4")


def test_bad_example_is_found(reports):
    mine = [x for x in reports["bad"] if x["category"] == "p2p-mismatch"]
    assert len(mine) == 1 and mine[0]["data"]["sent"] == 3 and mine[0]["data"]["received"] == 2
    assert mine[0]["locations"][0]["line"] == 23 and "dist.send" in mine[0]["locations"][0]["source"]
    assert [x["id"] for x in reports["bad"] if x["severity"] == "error"] == ["DD011"]


def test_good_example_is_silent(reports):
    assert [x["id"] for x in reports["good"] if x["category"] == "p2p-mismatch"
            or x["severity"] == "error"] == []
