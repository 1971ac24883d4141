"""End to end: the `checks/` example programs of ddp-manual-allreduce under `ddpdoctor trace`, on real gloo
jobs (the unit tests on hand-written traces are in tests/unit)."""

from __future__ import annotations

import pytest
from support.jobs import ROOT, example_reports

EXAMPLES = ROOT / "checks" / "ddp-manual-allreduce"


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return example_reports(tmp_path_factory, "ddp-manual-allreduce", failing=(), pg_timeout=None)


def test_bad_example_is_found(reports):
    mine = [x for x in reports["bad"] if x["category"] == "ddp-manual-allreduce"]
    assert len(mine) == 1 and mine[0]["severity"] == "error" and mine[0]["ranks"] == [0, 1]
    # gradient_as_bucket_view=True: both gradients named, each once
    assert mine[0]["data"]["names"] == ["weight.grad", "bias.grad"] and mine[0]["data"]["calls"] == 12
    bad = (EXAMPLES / "bad.py").read_text().splitlines()
    assert "dist.all_reduce(p.grad)" in bad[mine[0]["locations"][0]["line"] - 1]


def test_good_example_is_silent(reports):
    assert [x["id"] for x in reports["good"] if x["category"] == "ddp-manual-allreduce"
            or x["severity"] == "error"] == []
