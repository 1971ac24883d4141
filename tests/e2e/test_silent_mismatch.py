"""End to end: a mismatched all_gather that gloo completes on one rank and aborts on the other is
reported by DD002 as the root cause, with each rank's shapes (issue 13, item 5)."""

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
