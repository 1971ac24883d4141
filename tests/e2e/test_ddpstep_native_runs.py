"""End to end: the DDP backward event in C (ddpdoctor/rank/_ddpstep.c) writes the trace the
Python hook writes. A real 2-rank gloo program (non-finite output gradients on either rank, a
sum that overflows, a non-contiguous gradient, float64, no_sync), traced with the C hook and with
``DDPDOCTOR_NATIVE=0``: every record identical but for its timings, the losses those of an
untraced run, and the non-finite backwards found at the same steps on the same ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.jobs import read_records, run_bounded, torchrun, trace

pytest.importorskip("ddpdoctor.rank._ddpstep", reason="C extension not built (no compiler)")

PROG = Path(__file__).parent / "programs" / "ddp_backward_cases.py"
#: Fields that are times or durations, or name the process: they differ between any two runs.
TIMES = {"ts", "d", "t0", "wall", "pid", "time", "host", "start", "end", "elapsed", "wall0", "argv"}
KINDS = ("c", "e", "site", "ddp", "grad_nf", "grad_used")


def _losses(results: Path) -> dict:
    return {r: json.loads((results / f"result-rank{r}.json").read_text()) for r in (0, 1)}


def _run(tmp_path, native: str) -> tuple[dict, dict]:
    out, results = tmp_path / f"trace{native}", tmp_path / f"results{native}"
    results.mkdir()
    res = trace(torchrun(PROG, str(results)), out, "--no-report", env={"DDPDOCTOR_NATIVE": native})
    assert res.returncode == 0, res.stdout + res.stderr
    assert "internal error" not in res.stderr, res.stderr
    recs = {r: [{k: v for k, v in rec.items() if k not in TIMES}
                for rec in read_records(out, r) if rec["t"] in KINDS] for r in (0, 1)}
    return recs, _losses(results)


def test_backward_records_identical_with_native_hook_on_and_off(tmp_path):
    (on, on_losses), (off, off_losses) = _run(tmp_path, "1"), _run(tmp_path, "0")
    plain = tmp_path / "plain"
    plain.mkdir()
    res = run_bounded(torchrun(PROG, str(plain)), timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert on_losses == off_losses == _losses(plain)  # what the program computes, unchanged
    for r in (0, 1):
        assert on[r] == off[r]
        bwd = [x for x in on[r] if x.get("op") == "ddp_backward"]
        assert [x["step"] for x in bwd] == list(range(1, 11)) + [1, 2, 3, 4]
    nf = {r: [(x["id"], x["at"], x["step"], x.get("kind")) for x in on[r]
              if x["t"] == "grad_nf" and x["at"] == "local"] for r in (0, 1)}
    # NaN at step 4 (rank 1), Inf at step 6 (rank 0), NaN in the float64 module's 3rd backward
    # (rank 0); the overflowing sum (step 7) and the transposed gradient (step 8) are no finding
    assert nf == {0: [(0, "local", 6, "inf"), (1, "local", 3, "nan")], 1: [(0, "local", 4, "nan")]}
