"""nonfinite-gradients (DD015) on hand-written traces."""

from __future__ import annotations

from support.traces import run_check, write_traces

from ddpdoctor.analysis.checks.nonfinite_gradients import NonfiniteGradients

SITE = ("train.py", 30)


def nf(at: str, step: int, **fields) -> dict:
    return dict({"t": "grad_nf", "id": 0, "at": at, "step": step, "site": SITE}, **fields)


def test_local_skip_while_another_rank_applies_is_an_error(tmp_path):
    # rank 1's loss is NaN at backward 3 and it skips; rank 0 steps with the NaN average
    r0 = [nf("local", 4, kind="nan", pnf=1), nf("skip", 4, how="none"), nf("exit", 0, pnf=1)]
    r1 = [nf("local", 3, kind="nan", pnf=0), nf("skip", 3, how="none"), nf("exit", 0, pnf=1)]
    found = run_check(NonfiniteGradients, write_traces(tmp_path, {0: r0, 1: r1}))
    assert [(f.severity, f.data["step"], f.data["local"]) for f in found] == [("error", 3, [1])]
    assert 0 in found[0].data["applied"] and "backward 4" in found[0].message
    assert "NaN on rank 1 only" in found[0].message and found[0].locations[0].line == 30


def test_an_explicit_apply_is_an_error_with_the_step_site(tmp_path):
    r0 = [nf("local", 2, kind="inf", pnf=0), {**nf("apply", 2, n=3, names=["0.weight"]), "site": ("train.py", 40)}]
    found = run_check(NonfiniteGradients, write_traces(tmp_path, {0: r0, 1: []}))
    assert [(f.severity, f.data["applied"]) for f in found] == [("error", [0])]
    assert [loc.line for loc in found[0].locations] == [30, 40] and "Inf" in found[0].message


def test_gradscaler_skip_everywhere_is_info(tmp_path):
    r1 = [nf("local", 3, kind="nan", pnf=0), nf("skip", 3, how="scaler")]
    found = run_check(NonfiniteGradients, write_traces(tmp_path, {0: [], 1: r1}))
    assert [(f.severity, f.ranks) for f in found] == [("info", [1])]
    assert "GradScaler skipped" in found[0].message


def test_nonfinite_parameters_without_a_local_origin_are_an_error(tmp_path):
    # the NaN arose inside backward (not at the output) and was applied on every rank
    recs = [nf("local", 5, kind="nan", pnf=1), nf("exit", 0, pnf=1)]
    found = run_check(NonfiniteGradients, write_traces(tmp_path, {0: recs, 1: list(recs)}))
    assert [(f.severity, f.data["step"]) for f in found] == [("error", 5)]
    assert "arose inside backward" in found[0].message


def test_finite_runs_are_silent(tmp_path):
    assert run_check(NonfiniteGradients, write_traces(tmp_path, {0: [], 1: []})) == []


def test_malformed_records_give_no_traceback(tmp_path):
    junk = [{"t": "grad_nf", "id": "x", "at": "local", "step": "?", "site": SITE},
            {"t": "grad_nf", "at": "apply", "step": None, "n": "many"},
            {"t": "grad_nf", "id": 0, "at": "exit", "pnf": "yes", "site": SITE}]
    found = run_check(NonfiniteGradients, write_traces(tmp_path, {0: junk, 1: [nf("skip", 0, how=3)]}))
    assert all(f.id == "DD015" for f in found)
