"""End to end: the `checks/` example programs of replica-drift under `ddpdoctor trace`, on real gloo
jobs (the unit tests on hand-written traces are in tests/unit)."""

from __future__ import annotations

import pytest
from support.jobs import example_reports


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return example_reports(tmp_path_factory, "replica-drift", failing=())


def test_bad_example_is_found(reports):
    mine = [x for x in reports["bad"] if x["category"] == "replica-drift"]
    assert len(mine) == 1, [x["message"] for x in reports["bad"]]
    f = mine[0]
    assert f["severity"] == "error" and f["ranks"] == [0]
    assert f["data"]["names"] == ["2.weight"] and f["data"]["step"] == 1 and f["data"]["at"] == "step"
    assert "in-place write" in f["message"]


def test_good_example_is_silent(reports):
    assert [x["id"] for x in reports["good"] if x["category"] == "replica-drift"
            or x["severity"] in ("error", "warning")] == []
