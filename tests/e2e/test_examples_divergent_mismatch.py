"""End to end: the `checks/` example programs of divergent-collectives and collective-mismatch under `ddpdoctor trace`, on real gloo
jobs (the unit tests on hand-written traces are in tests/unit)."""

from __future__ import annotations

import pytest
from support.jobs import ROOT, findings_json, torchrun, trace


@pytest.mark.parametrize("category", ["divergent-collectives", "collective-mismatch"])
def test_examples_end_to_end(tmp_path, category):
    folder = ROOT / "checks" / category
    bad = trace(torchrun(folder / "bad.py"), tmp_path / "bad", "--hang-timeout", "5", "--on-hang", "kill",
                timeout=90, env={"EXAMPLE_PG_TIMEOUT": "60"})
    assert bad.returncode != 0
    doc = findings_json(tmp_path / "bad")
    found = [f for f in doc["findings"] if f["category"] == category]
    assert found and found[0]["severity"] == "error", [f["message"] for f in doc["findings"]]
    src = (folder / "bad.py").read_text().splitlines()
    bug_lines = {i for i, line in enumerate(src, 1) if "# the bug" in line or "# the step's" in line}
    assert bug_lines & {loc["line"] for loc in found[0]["locations"]}, found[0]["locations"]
    good = trace(torchrun(folder / "good.py"), tmp_path / "good", "--hang-timeout", "5", timeout=90)
    assert good.returncode == 0, good.stderr[-2000:]
    gdoc = findings_json(tmp_path / "good")
    assert not [f for f in gdoc["findings"] if f["severity"] == "error"], gdoc["findings"]


def test_divergent_example_blames_the_rank_that_left_the_loop(tmp_path):
    res = trace(torchrun(ROOT / "checks" / "divergent-collectives" / "bad.py"), tmp_path / "t", "--hang-timeout",
                "5", "--on-hang", "kill", timeout=90, env={"EXAMPLE_PG_TIMEOUT": "60"})
    assert res.returncode == 124
    f = [f for f in findings_json(tmp_path / "t")["findings"] if f["category"] == "divergent-collectives"][0]
    assert f["ranks"] == [0]
    assert {"condition", "exit", "loop"} <= {loc["role"] for loc in f["locations"]}
    assert "it left the loop at bad.py:20" in res.stderr  # the live diagnosis says it too
