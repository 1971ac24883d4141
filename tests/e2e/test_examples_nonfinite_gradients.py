"""End to end: the `checks/` example programs of nonfinite-gradients under `ddpdoctor trace`, on real
gloo jobs (the unit tests on hand-written traces are in tests/unit)."""

from __future__ import annotations

import pytest
from support.jobs import example_reports


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return example_reports(tmp_path_factory, "nonfinite-gradients", failing=())


def test_bad_example_is_found(reports):
    mine = [x for x in reports["bad"] if x["category"] == "nonfinite-gradients"]
    assert len(mine) == 1, [x["message"] for x in reports["bad"]]
    f = mine[0]
    # rank 1's NaN sample at loop step 2 (backward #3); rank 0 applied the average
    assert f["severity"] == "error" and f["data"]["step"] == 3 and f["data"]["local"] == [1]
    assert 0 in f["data"]["applied"]
    assert f["locations"][0]["line"] == 29 and "model(x)" in f["locations"][0]["source"]


def test_good_example_gets_only_the_skip_info(reports):
    mine = [x for x in reports["good"] if x["category"] == "nonfinite-gradients"]
    assert [(x["severity"], x["ranks"]) for x in mine] == [("info", [1])]
    assert "GradScaler skipped" in mine[0]["message"]
    assert [x["id"] for x in reports["good"] if x["severity"] in ("error", "warning")] == []
