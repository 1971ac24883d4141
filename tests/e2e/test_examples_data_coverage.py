"""End to end: the `checks/` example programs of data-coverage under `ddpdoctor trace`, on real gloo
jobs (the unit tests on hand-written traces are in tests/unit)."""

from __future__ import annotations

import pytest
from support.jobs import example_reports


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return example_reports(tmp_path_factory, "data-coverage", failing=())


def test_bad_example_is_found(reports):
    mine = {x["data"]["what"]: x for x in reports["bad"] if x["category"] == "data-coverage"}
    assert sorted(mine) == ["file-overlap", "sampler-overlap", "whole"], [x["message"] for x in reports["bad"]]
    assert {x["severity"] for x in mine.values()} == {"warning"}
    idx = mine["sampler-overlap"]
    # 32 samples in shards of 16 cut from two orders: overlap and gaps, both counted, over both passes
    assert idx["data"]["shared"] > 0 and idx["data"]["missing"] == idx["data"]["shared"] and idx["data"]["passes"] == 2
    assert [(loc["role"], loc["line"]) for loc in idx["locations"][:2]] == [("shuffle", 59), ("order", 60)]
    assert mine["whole"]["data"]["training"] is True and mine["whole"]["locations"][0]["line"] == 63
    files = mine["file-overlap"]
    assert [(loc["role"], loc["line"]) for loc in files["locations"][:2]] == [("shuffle", 73), ("read", 32)]
    assert files["data"]["shared"] >= 1 and "part" in files["message"]


def test_good_example_is_silent(reports):
    mine = [x for x in reports["good"] if x["category"] == "data-coverage"]
    assert [x["id"] for x in reports["good"] if x["severity"] in ("error", "warning")] == [], \
        [x["message"] for x in reports["good"]]
    # the evaluation every rank runs over the whole validation set: info, nothing louder
    assert [(x["severity"], x["data"]["what"], x["data"]["training"]) for x in mine] == [("info", "whole", False)]
