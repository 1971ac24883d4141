"""End to end: the `checks/` example programs of batchnorm-sync under `ddpdoctor trace`, on real gloo
jobs (the unit tests on hand-written traces are in tests/unit)."""

from __future__ import annotations

import pytest
from support.jobs import example_reports


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    # bad.py fails on CPU: the SyncBatchNorm layers swapped in under DDP refuse CPU tensors
    return example_reports(tmp_path_factory, "batchnorm-sync")


def test_bad_example_is_found(reports):
    mine = [x for x in reports["bad"] if x["category"] == "batchnorm-sync"]
    assert len(mine) == 1, [x["message"] for x in reports["bad"]]
    assert mine[0]["severity"] == "error" and mine[0]["ranks"] == [0, 1]
    assert mine[0]["locations"][0]["line"] == 26 and "convert_sync_batchnorm" in mine[0]["locations"][0]["source"]


def test_good_example_is_silent(reports):
    assert [x["id"] for x in reports["good"] if x["category"] == "batchnorm-sync"
            or x["severity"] in ("error", "warning")] == []
