"""A job whose process group is created by init_device_mesh is traced like any other."""

from __future__ import annotations

from support.jobs import ROOT, findings_json, read_records, torchrun, trace

PROGRAM = ROOT / "tests" / "e2e" / "programs" / "device_mesh_init.py"


def test_init_device_mesh_job_is_traced(tmp_path):
    out = tmp_path / "trace"
    res = trace(torchrun(PROGRAM), out, "--hang-timeout", "60", "--no-report", timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count(" total ") == 2
    doc = findings_json(out)
    assert doc["run"]["ranks_found"] == [0, 1]
    assert not doc["findings"], [f["message"] for f in doc["findings"]]
    for rank in (0, 1):
        recs = read_records(out, rank)
        init = [r for r in recs if r["t"] == "init"]
        assert len(init) == 1 and "gloo" in init[0]["backend"], init
        assert [r["op"] for r in recs if r["t"] == "c" and r.get("op") == "all_reduce"] == ["all_reduce"]
