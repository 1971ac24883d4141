"""End to end: the `checks/` example programs of uneven-inputs under `ddpdoctor trace`, on real gloo
jobs (the unit tests on hand-written traces are in tests/unit)."""

from __future__ import annotations

import pytest
from support.jobs import example_reports


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return example_reports(tmp_path_factory, "uneven-inputs", names=("bad", "good", "bad-early", "good-early"),
                           failing=("bad", "bad-early"))


def test_bad_example_is_found(reports):
    mine = [x for x in reports["bad"] if x["category"] == "uneven-inputs"]
    assert len(mine) == 1 and mine[0]["ranks"] == [0]
    assert mine[0]["data"]["steps"] == {"0": 5, "1": 4}
    assert any(loc["role"] == "loop" and "for x in mine" in loc["source"] for loc in mine[0]["locations"])
    # one explanation, not two: no divergence or rank failure reported for the same thing
    assert [x["id"] for x in reports["bad"] if x["severity"] == "error"] == ["DD006"]


def test_good_example_with_join_is_silent(reports):
    assert [x["id"] for x in reports["good"] if x["category"] == "uneven-inputs"
            or x["severity"] == "error"] == []


def test_early_stopping_on_a_local_loss_names_the_break_and_its_condition(reports):
    mine = [x for x in reports["bad-early"] if x["severity"] == "error"]
    assert [x["id"] for x in mine] == ["DD006"], [x["message"] for x in reports["bad-early"]]
    roles = {(loc["role"], loc["source"]) for loc in mine[0]["locations"]}
    assert ("condition", "if stale >= 2:") in roles and ("exit", "break") in roles
    assert "all-reduced or broadcast" in mine[0]["message"]


def test_early_stopping_on_the_averaged_loss_is_silent(reports):
    assert [x["id"] for x in reports["good-early"] if x["severity"] in ("error", "warning")] == []
