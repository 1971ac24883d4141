"""End to end: the `checks/` example programs of sync-overhead under `ddpdoctor trace`, on real gloo
jobs (the unit tests on hand-written traces are in tests/unit)."""

from __future__ import annotations

import pytest
from support.jobs import example_reports


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return example_reports(tmp_path_factory, "sync-overhead", failing=(), pg_timeout=None)


def test_bad_example_is_found(reports):
    mine = {x["data"]["kind"]: x for x in reports["bad"] if x["category"] == "sync-overhead"}
    assert "barrier" in mine, reports["bad"]
    assert mine["barrier"]["data"]["calls"] == 40 and mine["barrier"]["locations"][0]["line"] == 34
    # rank 1 sleeps 50 ms per step before the barrier: rank 0 loses ~2 s
    assert mine["barrier"]["data"]["max_s"] > 1.2
    assert "straggler" in mine and mine["straggler"]["ranks"] == [1]
    assert [x for x in reports["bad"] if x["severity"] == "error"] == []


def test_good_example_is_silent(reports):
    assert [x["id"] for x in reports["good"] if x["category"] == "sync-overhead"
            or x["severity"] == "error"] == []
