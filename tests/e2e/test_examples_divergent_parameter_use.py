"""End to end: the `checks/` example programs of divergent-parameter-use under `ddpdoctor trace`, on
real gloo jobs (the unit tests on hand-written traces are in tests/unit)."""

from __future__ import annotations

import pytest
from support.jobs import example_reports


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    # bad-fsdp: rank 1 dies in the mismatched all-gather (gloo aborts on different sizes)
    return example_reports(tmp_path_factory, "divergent-parameter-use",
                           names=("bad", "good", "bad-fsdp", "good-fsdp"), failing=("bad-fsdp",))


def test_bad_example_is_found(reports):
    mine = [x for x in reports["bad"] if x["category"] == "divergent-parameter-use"]
    assert len(mine) == 1, [x["message"] for x in reports["bad"]]
    f = mine[0]
    assert f["severity"] == "error" and f["data"]["step"] == 1 and f["data"]["decided_by"] == "random"
    assert set(f["data"]["modules"]) <= {"blocks.0", "blocks.1", "blocks.2"}
    cond = f["locations"][0]
    assert (cond["line"], cond["role"]) == (28, "condition") and "torch.rand" in cond["source"]


def test_good_example_is_silent(reports):
    assert [x["id"] for x in reports["good"] if x["category"] == "divergent-parameter-use"
            or x["severity"] in ("error", "warning")] == []


def test_bad_fsdp_names_the_module_and_the_condition(reports):
    mine = [x for x in reports["bad-fsdp"] if x["category"] == "divergent-parameter-use"]
    assert len(mine) == 1, [x["message"] for x in reports["bad-fsdp"]]
    f = mine[0]
    assert f["severity"] == "error" and f["ranks"] == [0] and f["data"]["calls"]["0"] == ["self.extra"]
    cond = f["locations"][0]
    assert (cond["line"], cond["role"]) == (62, "condition") and "get_rank" in cond["source"]
    # divergent-collectives leaves the root cause to this check
    assert [x for x in reports["bad-fsdp"] if x["id"] == "DD001"] == []


def test_good_fsdp_is_silent(reports):
    assert [x["id"] for x in reports["good-fsdp"] if x["severity"] in ("error", "warning")] == []
