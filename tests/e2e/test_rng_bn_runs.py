"""End to end on real gloo jobs: Python/NumPy randomness deciding the set-up (unseeded-rng, DD004)
and BatchNorm train/eval modes differing across ranks at the same step (batchnorm-sync, DD014),
each with a correct program that must stay without error or warning."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from support.jobs import ROOT, findings_json, read_records, torchrun, trace

SILENT = ROOT / "tests" / "e2e" / "silent_programs"
CORRECT = ROOT / "tests" / "e2e" / "correct_programs"


def _line(path, marker: str) -> int:
    return next(i for i, s in enumerate(path.read_text().splitlines(), 1) if marker in s)


def _run(tmp_path, prog):
    out = tmp_path / "t"
    res = trace(torchrun(prog), out, "--no-report", "--hang-timeout", "20", timeout=120)
    assert res.returncode in (0, 1), res.stderr[-3000:]  # 1: findings
    return out, findings_json(out)["findings"]


def test_python_and_numpy_draws_seeded_by_rank_are_found_at_their_lines(tmp_path):
    prog = SILENT / "pyrng_setup.py"
    out, found = _run(tmp_path, prog)
    draws = {f["data"]["fn"]: f for f in found if f["id"] == "DD004" and f["data"].get("what") == "draw"}
    assert set(draws) == {"shuffle", "permutation"}, [f["message"] for f in found]
    for fn, marker, seeder in (("shuffle", "random.shuffle(files)", "    random.seed(rank)"),
                               ("permutation", "np.random.permutation(40)", "    np.random.seed(rank)")):
        f = draws[fn]
        assert f["severity"] == "error" and f["data"]["seeded"] == "rank"
        lines = {loc["role"]: loc["line"] for loc in f["locations"]}
        assert lines == {"draw": _line(prog, marker), "seed": _line(prog, seeder)}
    # the sampler over the permuted Subset differs too, and names the permutation as the likely cause
    samp = [f for f in found if f["id"] == "DD004" and f["data"].get("what") == "sampler"]
    assert samp and f"np.random.permutation at pyrng_setup.py:{_line(prog, 'np.random.permutation(40)')}" in samp[0]["message"]
    # the augmentation in the training loop is never recorded (the window closed at the DataLoader)
    for rank in (0, 1):
        rng = [r for r in read_records(out, rank) if r["t"] == "rng"]
        assert [(r["op"], r.get("fn")) for r in rng] == [("draw", "shuffle"), ("draw", "permutation"), ("end", None)]
        assert rng[-1]["why"] == "iter"


def test_rank0_left_in_eval_mode_is_found_at_the_next_step(tmp_path):
    prog = SILENT / "bn_mode_rank0.py"
    out, found = _run(tmp_path, prog)
    mode = [f for f in found if f["id"] == "DD014" and f["data"].get("op") == "mode"]
    assert len(mode) == 1, [f["message"] for f in found]
    assert mode[0]["severity"] == "error" and mode[0]["data"]["step"] == 5
    assert mode[0]["data"]["modes"] == {"0": "eval mode", "1": "train mode"}
    assert [(loc["rank"], loc["line"]) for loc in mode[0]["locations"]] == [(0, _line(prog, "# the bug"))]


@pytest.mark.parametrize("program", ["per_rank_augment.py", "rank0_eval_bn.py"])
def test_correct_program_has_no_error_or_warning(tmp_path, program):
    out = tmp_path / "t"
    res = trace(torchrun(CORRECT / program), out, "--hang-timeout", "20", timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    found = findings_json(out)["findings"]
    assert not [f["message"] for f in found if f["severity"] in ("error", "warning")]
    if program == "per_rank_augment.py":  # the loop's draws were recorded, and judged per-step
        assert any(r["t"] == "rng" and r.get("fn") == "choice" for r in read_records(out, 0))
        assert {f["data"]["what"] for f in found if f["id"] == "DD004"} <= {"seed"}
    else:  # rank 0's evaluations were recorded, and never compared
        assert sum(r["t"] == "bn" and r.get("op") == "mode" for r in read_records(out, 0)) >= 4


PROG = textwrap.dedent("""
    import random
    import numpy as np
    import torch
    import torch.nn as nn
    from torch.nn.modules import module as mod
    from torch.utils.data import DataLoader
    from ddpdoctor.rank.patches import pyrng

    orig = {n: getattr(random, n) for n in ("shuffle", "choice", "random")}
    orig_np = {n: getattr(np.random, n) for n in ("permutation", "choice")}
    orig_iter = DataLoader.__iter__
    random.seed(3); np.random.seed(3)
    want = (random.sample(range(50), 5), list(np.random.permutation(9)), random.random())
    pyrng.patch()
    assert random.shuffle is not orig["shuffle"] and np.random.permutation is not orig_np["permutation"]
    assert DataLoader.__iter__ is not orig_iter and mod._global_forward_pre_hooks
    random.seed(3); np.random.seed(3)
    got = (random.sample(range(50), 5), list(np.random.permutation(9)), random.random())
    assert got == want, (got, want)  # the wrappers return what the functions return
    nn.Linear(2, 2)(torch.ones(1, 2))  # the first forward closes the window
    assert all(getattr(random, n) is f for n, f in orig.items())
    assert all(getattr(np.random, n) is f for n, f in orig_np.items())
    assert DataLoader.__iter__ is orig_iter and not mod._global_forward_pre_hooks
    assert getattr(random.seed, "__ddpdoctor_wrapped__", False)  # seeds stay recorded
    print("ok")
""")


def test_window_wraps_returns_unchanged_and_unwraps_at_first_forward():
    res = subprocess.run([sys.executable, "-c", PROG], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]


def test_architecture_chosen_per_rank_is_the_root_cause_of_the_ddp_failure(tmp_path):
    prog = SILENT / "pyrng_arch.py"
    out = tmp_path / "t"
    res = trace(torchrun(prog), out, "--no-report", "--hang-timeout", "10", "--on-hang", "kill", timeout=120)
    assert res.returncode != 0
    found = findings_json(out)["findings"]
    draws = [f for f in found if f["id"] == "DD004" and f["data"].get("what") == "draw"]
    assert [(f["data"]["fn"], f["severity"]) for f in draws] == [("choice", "error")], [f["message"] for f in found]
    lines = {loc["role"]: loc["line"] for loc in draws[0]["locations"]}
    assert lines == {"draw": _line(prog, "random.choice("), "seed": _line(prog, "random.seed(rank)")}


def test_window_closes_after_a_loop_of_draws():
    prog = textwrap.dedent("""
        import random
        import torch  # noqa: F401
        from ddpdoctor.rank.patches import pyrng
        orig = random.random
        pyrng.patch()
        assert random.random is not orig
        for _ in range(pyrng.CALLS + 1):
            random.random()
        assert random.random is orig and not pyrng._state["open"]
        print("ok")
    """)
    res = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]
