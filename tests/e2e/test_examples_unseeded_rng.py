"""End to end: the `checks/` example programs of unseeded-rng under `ddpdoctor trace`, on real gloo
jobs (the unit tests on hand-written traces are in tests/unit)."""

from __future__ import annotations

import pytest
from support.jobs import ROOT, example_reports

EXAMPLES = ROOT / "checks" / "unseeded-rng"


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return example_reports(tmp_path_factory, "unseeded-rng", failing=(), pg_timeout=None)


def test_bad_example_is_found(reports):
    mine = {x["data"]["what"]: x for x in reports["bad"] if x["category"] == "unseeded-rng"}
    assert set(mine) == {"split", "model-init"}
    assert mine["split"]["severity"] == "error" and mine["split"]["data"]["feeds_sampler"] == [0, 1]
    assert mine["model-init"]["severity"] == "error" and mine["model-init"]["data"]["grads_synced"]
    for x in mine.values():  # the cause: the rank-dependent seed, at its line
        seeds = [loc for loc in x["locations"] if loc["role"] == "seed"]
        assert seeds and "manual_seed(rank)" in seeds[0]["source"]


def test_good_example_is_silent(reports):
    assert [x["id"] for x in reports["good"] if x["category"] == "unseeded-rng"
            or x["severity"] == "error"] == []
