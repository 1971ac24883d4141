"""No false errors: correct, real-world style distributed programs report no error finding.

A false error on a correct program costs as much as a missed bug; these programs combine the
patterns that naive checkers flag (rank-0-only checkpointing, logging and evaluation, per-rank
augmentation, object collectives, async ops, subgroups, p2p pipelines, Join with uneven inputs).
"""

from __future__ import annotations

import pytest
from support.jobs import ROOT, findings_json, read_records, torchrun, trace

PROGRAMS = ROOT / "tests" / "e2e" / "correct_programs"


@pytest.mark.parametrize("program", ["ddp_training.py", "subgroups_p2p.py", "join_uneven.py", "silent_ok.py",
                                     "uneven_data.py", "grads_ok.py", "optim_wrappers.py",
                                     "pipeline_schedule.py"])
def test_correct_program_has_no_error(tmp_path, program):
    out = tmp_path / "trace"
    res = trace(torchrun(PROGRAMS / program), out, "--hang-timeout", "20", timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    doc = findings_json(out)
    errors = [f for f in doc["findings"] if f["severity"] == "error"]
    warnings = [f for f in doc["findings"] if f["severity"] == "warning"]
    assert not errors, [f["message"] for f in errors]
    assert not warnings, [f["message"] for f in warnings]
    assert doc["run"]["ranks_found"] == [0, 1]


def test_silent_ok_gets_only_the_batchnorm_checkpoint_info(tmp_path):
    """silent_ok.py trains plain BatchNorm on CPU (16 samples per rank; DDP refuses SyncBatchNorm
    for CPU modules, so no small-batch advice) and saves from rank 0: the checkpoint-statistics info
    of batchnorm-sync, nothing louder; the recorded per-rank batch sizes are right."""
    out = tmp_path / "trace"
    res = trace(torchrun(PROGRAMS / "silent_ok.py"), out, "--hang-timeout", "20", timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    found = findings_json(out)["findings"]
    assert {f["severity"] for f in found} <= {"info"}, [f["message"] for f in found]
    assert [f["title"].split(" ")[0] for f in found if f["id"] == "DD014"] == ["Checkpoint"]
    for rank in (0, 1):
        bn = [r for r in read_records(out, rank) if r["t"] == "bn" and r["op"] != "mode"]  # modes: test_rng_bn_runs
        assert [(r["op"], r.get("n"), r.get("dev")) for r in bn] == [("layers", None, "cpu"), ("batch", 16, None)]


def test_grads_ok_gets_only_the_skip_and_routing_infos(tmp_path):
    """grads_ok.py: rank 1's corrupt sample is skipped everywhere by GradScaler (DD015 info), the
    data-dependent expert route is DD016 info; the evaluation-only head and the layer drop seeded
    alike on every rank are not reported."""
    out = tmp_path / "trace"
    res = trace(torchrun(PROGRAMS / "grads_ok.py"), out, "--hang-timeout", "20", timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    found = findings_json(out)["findings"]
    assert {f["severity"] for f in found} <= {"info"}, [f["message"] for f in found]
    nf = [f for f in found if f["id"] == "DD015"]
    assert [(f["data"]["step"], f["data"]["local"]) for f in nf] == [(4, [1])]
    use = [f for f in found if f["id"] == "DD016"]
    assert [f["data"]["modules"] for f in use] == [["experts.0", "experts.1"]]
