"""End to end: the `checks/` example programs of data-coverage under `ddpdoctor trace`, on real gloo
jobs (the unit tests on hand-written traces are in tests/unit)."""

from __future__ import annotations

import pytest
from support.jobs import ROOT, example_reports, findings_json, run_bounded, torchrun, trace


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return example_reports(tmp_path_factory, "data-coverage", failing=())


def test_bad_example_is_found(reports):
    mine = {x["data"]["what"]: x for x in reports["bad"] if x["category"] == "data-coverage"}
    assert sorted(mine) == ["file-overlap", "same-batches", "sampler-overlap", "whole"], \
        [x["message"] for x in reports["bad"]]
    assert {x["severity"] for x in mine.values()} == {"warning"}
    idx = mine["sampler-overlap"]
    # 32 samples in shards of 16 cut from two orders: overlap and gaps, both counted, over both passes
    assert idx["data"]["shared"] > 0 and idx["data"]["missing"] == idx["data"]["shared"] and idx["data"]["passes"] == 2
    assert [(loc["role"], loc["line"]) for loc in idx["locations"][:2]] == [("shuffle", 61), ("order", 62)]
    assert mine["whole"]["data"]["training"] is True and mine["whole"]["locations"][0]["line"] == 65
    files = mine["file-overlap"]
    assert [(loc["role"], loc["line"]) for loc in files["locations"][:2]] == [("shuffle", 75), ("read", 34)]
    assert files["data"]["shared"] >= 1 and "part" in files["message"]
    same = mine["same-batches"]
    assert same["ranks"] == [0, 1] and same["data"]["passes"] == 2 and same["locations"][0]["line"] == 80


def test_good_example_is_silent(reports):
    mine = [x for x in reports["good"] if x["category"] == "data-coverage"]
    assert [x["id"] for x in reports["good"] if x["severity"] in ("error", "warning")] == [], \
        [x["message"] for x in reports["good"]]
    # the evaluation every rank runs over the whole validation set: info, nothing louder
    assert [(x["severity"], x["data"]["what"], x["data"]["training"]) for x in mine] == [("info", "whole", False)]


def test_same_sampler_rank_and_unsharded_files_on_real_ranks(tmp_path):
    """tests/e2e/programs/coverage_cases.py: the findings, and the program's results unchanged."""
    prog = ROOT / "tests" / "e2e" / "programs" / "coverage_cases.py"
    plain = run_bounded(torchrun(prog), timeout=120)
    out = tmp_path / "trace"
    res = trace(torchrun(prog), out, "--no-report", "--hang-timeout", "20", timeout=120)
    assert res.returncode == 0 == plain.returncode, res.stderr[-3000:]
    totals = sorted(line for line in res.stdout.splitlines() if line.startswith("rank "))
    assert totals == sorted(line for line in plain.stdout.splitlines() if line.startswith("rank ")) and len(totals) == 2
    found = {f["data"]["what"]: f for f in findings_json(out)["findings"] if f["category"] == "data-coverage"}
    assert sorted(found) == ["overlap", "same-batches", "same-files"], [f["message"] for f in found.values()]
    lines = {m: i + 1 for i, text in enumerate(prog.read_text().splitlines())
             for m in ("L:same-rank", "L:all-files", "L:same-stream") if m in text}
    assert found["overlap"]["severity"] == "error" and found["overlap"]["locations"][0]["line"] == lines["L:same-rank"]
    assert found["same-files"]["severity"] == "warning" and found["same-files"]["data"]["files"] == 3
    assert found["same-files"]["locations"][1]["line"] == lines["L:all-files"]
    # the unsharded stream (pass 0 of that loop's loader); the sharded pass after it is silent
    same = found["same-batches"]
    assert same["severity"] == "warning" and same["ranks"] == [0, 1] and same["data"]["passes"] == 1
    assert [(loc["role"], loc["line"]) for loc in same["locations"]] == [("loader", lines["L:same-stream"]),
                                                                         ("iteration", lines["L:same-stream"])]
