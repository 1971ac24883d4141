"""End to end: the `checks/` example programs of rank-failed under `ddpdoctor trace`, on real gloo
jobs (the unit tests on hand-written traces are in tests/unit)."""

from __future__ import annotations

import pytest
from support.jobs import example_reports


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return example_reports(tmp_path_factory, "rank-failed")


def test_bad_example_names_rank_1_not_its_victim(reports):
    mine = [x for x in reports["bad"] if x["category"] == "rank-failed"]
    assert len(mine) == 1 and mine[0]["ranks"] == [1]
    assert mine[0]["data"]["exc"] == "ValueError: corrupt sample at step 2"
    exc = [loc for loc in mine[0]["locations"] if loc["role"] == "exception"]
    assert exc and exc[0]["line"] == 17 and exc[0]["function"] == "load_sample"
    # rank 0 failed with a connection error, or was ended by torchrun: either way, collateral
    assert 0 not in mine[0]["ranks"]
    assert [x["id"] for x in reports["bad"] if x["severity"] == "error"] == ["DD008"]


def test_good_example_is_silent(reports):
    assert [x["id"] for x in reports["good"] if x["category"] == "rank-failed"
            or x["severity"] == "error"] == []
