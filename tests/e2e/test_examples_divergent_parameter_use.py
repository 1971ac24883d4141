"""End to end: the `checks/` example programs of divergent-parameter-use under `ddpdoctor trace`, on
real gloo jobs (the unit tests on hand-written traces are in tests/unit)."""

from __future__ import annotations

import pytest
from support.jobs import example_reports


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return example_reports(tmp_path_factory, "divergent-parameter-use", failing=())


def test_bad_example_is_found(reports):
    mine = [x for x in reports["bad"] if x["category"] == "divergent-parameter-use"]
    assert len(mine) == 1, [x["message"] for x in reports["bad"]]
    f = mine[0]
    assert f["severity"] == "error" and f["data"]["step"] == 1 and f["data"]["decided_by"] == "random"
    assert set(f["data"]["modules"]) <= {"blocks.0", "blocks.1", "blocks.2"}
    cond = f["locations"][0]
    assert (cond["line"], cond["role"]) == (27, "condition") and "torch.rand" in cond["source"]


def test_good_example_is_silent(reports):
    assert [x["id"] for x in reports["good"] if x["category"] == "divergent-parameter-use"
            or x["severity"] in ("error", "warning")] == []
