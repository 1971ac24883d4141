"""End to end: the `checks/` example programs of sampler-misuse under `ddpdoctor trace`, on real gloo
jobs (the unit tests on hand-written traces are in tests/unit)."""

from __future__ import annotations

import pytest
from support.jobs import ROOT, example_reports

EXAMPLES = ROOT / "checks" / "sampler-misuse"


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return example_reports(tmp_path_factory, "sampler-misuse", failing=(), pg_timeout=None)


def test_bad_example_is_found(reports):
    mine = {x["data"]["what"]: x for x in reports["bad"] if x["category"] == "sampler-misuse"}
    assert set(mine) == {"no-set-epoch", "padding"}
    assert mine["no-set-epoch"]["data"]["iterations"] == 3
    assert mine["padding"]["data"]["duplicates"] == 1 and mine["padding"]["data"]["n"] == 11
    src = (EXAMPLES / "bad.py").read_text().splitlines()
    line = mine["no-set-epoch"]["locations"][0]["line"]
    assert "DistributedSampler(train, shuffle=True)" in src[line - 1]


def test_good_example_is_silent(reports):
    assert [x["id"] for x in reports["good"] if x["category"] == "sampler-misuse"
            or x["severity"] == "error"] == []
