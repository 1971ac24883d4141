"""End to end (issue 13): the root cause of a failure that happens later than the bug: a mismatched
all_gather that gloo completes on one rank (DD002, item 5), a file checked for before it is written
(DD003, item 4)."""

from __future__ import annotations

from support.jobs import ROOT, findings_json, torchrun, trace


def test_mismatch_completed_on_one_rank_is_the_root_cause(tmp_path):
    prog = ROOT / "tests" / "e2e" / "silent_programs" / "gather_mismatch_later.py"
    res = trace(torchrun(prog), tmp_path / "t", "--no-report", "--hang-timeout", "8", "--on-hang", "kill",
                timeout=90)
    assert res.returncode != 0
    findings = findings_json(tmp_path / "t")["findings"]
    mism = [f for f in findings if f["id"] == "DD002"]
    assert mism, [f["message"] for f in findings]
    assert mism[0]["data"]["op"] == "all_gather" and mism[0]["data"]["seq"] == 2
    assert "float32[4000]" in mism[0]["message"] and "float32[5000]" in mism[0]["message"]
    assert mism[0]["locations"][0]["line"] == 19
    assert "root cause" in mism[0]["message"]
    # the crash may still be described, but after the root cause and never as a divergence
    assert findings[0]["id"] == "DD002"
    assert not [f for f in findings if f["id"] == "DD001"]


def test_rank_failing_on_a_file_not_written_yet_is_a_missing_barrier(tmp_path):
    prog = ROOT / "tests" / "e2e" / "silent_programs" / "exists_race.py"
    res = trace(torchrun(prog), tmp_path / "t", "--no-report", "--hang-timeout", "8", "--on-hang", "kill",
                timeout=90, env={"EXAMPLE_PG_TIMEOUT": "10"})
    assert res.returncode != 0
    findings = findings_json(tmp_path / "t")["findings"]
    mb = [f for f in findings if f["id"] == "DD003"]
    assert mb, [f["message"] for f in findings]
    src = prog.read_text().splitlines()
    line = {m: next(i for i, s in enumerate(src, 1) if m in s) for m in ("# the write", "# the check")}
    assert {(loc["role"], loc["rank"], loc["line"]) for loc in mb[0]["locations"]} == {
        ("write", 0, line["# the write"]), ("read", 1, line["# the check"])}
    assert "did not yet" in mb[0]["message"] and "FileNotFoundError" in mb[0]["message"]
