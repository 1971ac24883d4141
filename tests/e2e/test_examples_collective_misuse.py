"""End to end: the `checks/` example programs of collective-misuse under `ddpdoctor trace`, on real gloo
jobs (the unit tests on hand-written traces are in tests/unit)."""

from __future__ import annotations

import pytest
from support.jobs import example_reports


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return example_reports(tmp_path_factory, "collective-misuse", names=("bad", "good", "bad-groups"), pg_timeout=None)


def test_bad_example_is_found(reports):
    mine = [x for x in reports["bad"] if x["category"] == "collective-misuse"]
    assert len(mine) == 1 and mine[0]["ranks"] == [0, 1] and mine[0]["data"]["when"] == "after"
    roles = {loc["role"]: loc["line"] for loc in mine[0]["locations"]}
    assert roles == {"call": 36, "destroy": 19}
    assert [x["id"] for x in reports["bad"] if x["severity"] == "error"] == ["DD012"]


def test_bad_example_groups_variant(reports):
    mine = [x for x in reports["bad-groups"] if x["category"] == "collective-misuse"]
    assert len(mine) == 1 and mine[0]["data"]["kind"] == "members" and mine[0]["ranks"] == [0, 1]
    assert "members [0]" in mine[0]["message"] and "members [1]" in mine[0]["message"]
    assert mine[0]["locations"][0]["line"] == 27 and "new_group" in mine[0]["locations"][0]["source"]


def test_good_example_is_silent(reports):
    assert [x["id"] for x in reports["good"] if x["category"] == "collective-misuse"
            or x["severity"] == "error"] == []
