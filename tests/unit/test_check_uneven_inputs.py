"""uneven-inputs (DD006): ranks ran different numbers of DDP steps.

Unit tests on hand-written traces (the bad/good programs run end to end in tests/e2e)."""

from __future__ import annotations

import time

from support.traces import (
    GLOO_CLOSED,
    GLOO_TIMEOUT,
    coll,
    ddp_record,
    ddp_steps,
    raised,
    run_checks,
    write_run,
)

STEP = ("train.py", 30, "loss = model(x)", [["train.py", 28, "for x in batches:", "for"]])


def uneven_run(tmp_path, n_long=5, n_short=4, short_next=None, long_exit=None, short_exit=None, extra=None):
    """Rank 0 runs n_long steps, its last backward in flight when it fails; rank 1 runs n_short
    and then calls ``short_next`` (or nothing). ``extra[r]``: records rank r writes first."""
    extra = extra or {}
    long = extra.get(0, []) + [coll(1, "ddp_init", ("train.py", 20)), ddp_record()] + ddp_steps(n_long - 1, site=STEP)
    long += [{"t": "e", "op": "ddp_forward", "g": "0", "s": 0, "d": 5, "site": STEP, "grad": 1}]
    seq = 1 + n_long
    inflight = [["ddp_backward", "0", seq, STEP, 99000]]
    short = extra.get(1, []) + [coll(1, "ddp_init", ("train.py", 20)), ddp_record()] + ddp_steps(n_short, site=STEP)
    if short_next is not None:
        short.append(coll(2 + n_short, short_next, ("train.py", 40, "dist.barrier()")))
    exits = {0: long_exit or raised(GLOO_CLOSED, line=31, inflight=inflight), 1: short_exit}
    if short_exit is None:
        exits.pop(1)
    return write_run(tmp_path, {0: long, 1: short}, exits=exits)


def test_extra_step_is_found_and_divergence_not_double_reported(tmp_path):
    folder = uneven_run(tmp_path / "a")
    found = run_checks(folder, "DD006", "DD001", "DD008")
    assert [f.id for f in found] == ["DD006"]
    f = found[0]
    assert f.ranks == [0] and f.severity == "error"
    assert f.data["steps"] == {"0": 5, "1": 4} and f.data["short"] == [1]
    assert "rank 0: 5 steps (the last one still waiting in its gradient all-reduce)" in f.message
    assert "rank 1: 4 steps" in f.message and "rank 1 exited normally" in f.message
    assert {(loc.role, loc.line) for loc in f.locations} == {("call", 30), ("loop", 28)}
    assert "Join" in f.fix and "drop_last" in f.fix
    # without uneven-inputs in the report, divergent-collectives reports the divergence itself
    alone = run_checks(folder, "DD001", select={"DD001"})
    assert [x.id for x in alone] == ["DD001"] and "DDP backward" in alone[0].message


def test_short_rank_calling_another_collective_is_named(tmp_path):
    folder = uneven_run(tmp_path, short_next="barrier", short_exit=raised(GLOO_TIMEOUT, line=40))
    found = run_checks(folder, "DD006", "DD001", "DD008")
    assert [f.id for f in found] == ["DD006"]
    assert "rank 1 called barrier #6 at train.py:40" in found[0].message


def test_equal_steps_evaluation_and_join_are_silent(tmp_path):
    base = [coll(1, "ddp_init", ("train.py", 20)), ddp_record()] + ddp_steps(4, site=STEP)
    # rank 0 evaluates 3 batches more under no_grad (non-communicating forwards): not steps
    evals = [{"t": "e", "op": "ddp_forward", "g": "0", "s": 0, "d": 5, "site": ("train.py", 50)}] * 3
    join = [{"t": "e", "op": "join_enter", "site": ("train.py", 27)},
            {"t": "c", "op": "join", "g": "0", "s": 6, "d": 100, "site": ("train.py", 27)}]
    folder = write_run(tmp_path, {0: base + evals + join, 1: base + join})
    assert run_checks(folder, "DD006", "DD001") == []


def test_short_rank_that_died_is_left_to_rank_failed(tmp_path):
    folder = uneven_run(tmp_path, short_exit=raised("ValueError: corrupt sample", line=12))
    found = run_checks(folder)
    assert [f.id for f in found if f.severity == "error"] == ["DD008"]


def test_rank_dependent_branch_is_left_to_divergent_collectives(tmp_path):
    cond = ("train.py", 60, "model(probe)", [["train.py", 59, "if rank == 0:", "if"]])
    base = [coll(1, "ddp_init", ("train.py", 20)), ddp_record()] + ddp_steps(3, site=STEP)
    extra = [{"t": "c", "op": "ddp_forward", "g": "0", "s": 5, "d": 10, "site": cond, "grad": 1}]
    folder = write_run(tmp_path, {0: base + extra, 1: base + [coll(5, "barrier", ("train.py", 62))]})
    found = run_checks(folder, "DD006", "DD001")
    assert [f.id for f in found] == ["DD001"] and found[0].ranks == [0]


def test_killed_rank_with_an_unfinished_training_forward(tmp_path):
    # equal all-reduces, but rank 0 was killed right after a 5th training forward (SIGKILL)
    base = [coll(1, "ddp_init", ("train.py", 20)), ddp_record()] + ddp_steps(4, site=STEP)
    fwd = {"t": "e", "op": "ddp_forward", "g": "0", "s": 0, "d": 5, "site": STEP, "grad": 1}
    folder = write_run(tmp_path, {0: base + [fwd], 1: base}, exits={0: None}, dumps=(0,))
    found = run_checks(folder, "DD006")
    assert len(found) == 1 and found[0].ranks == [0] and found[0].data["steps"] == {"0": 5, "1": 4}
    # the same extra forward on a rank that then exited normally (an eval with grad on): silent
    folder = write_run(tmp_path / "b", {0: base + [fwd], 1: base})
    assert run_checks(folder, "DD006") == []
    # the whole job killed mid-step (both ranks without exit record): a snapshot, not uneven data
    folder = write_run(tmp_path / "c", {0: base + [fwd], 1: base}, exits={0: None, 1: None})
    assert run_checks(folder, "DD006") == []


def test_ranks_training_different_ddp_groups_are_not_compared(tmp_path):
    stage = {r: [ddp_record(g=f"s{r}")] + ddp_steps(3 + r, g=f"s{r}", site=STEP) for r in (0, 1)}
    assert run_checks(write_run(tmp_path, stage), "DD006") == []


def test_hundreds_of_ranks_one_short(tmp_path):
    world = 256
    ranks = {}
    exits = {}
    for r in range(world):
        n = 11 if r == 77 else 12
        ranks[r] = [coll(1, "ddp_init", ("train.py", 20)), ddp_record()] + ddp_steps(n, site=STEP)
        if r != 77:
            ranks[r] = ranks[r][:-1]
            exits[r] = raised(GLOO_CLOSED, line=31, inflight=[["ddp_backward", "0", 13, STEP, 5]])
    folder = write_run(tmp_path, ranks, exits=exits)
    t0 = time.perf_counter()
    found = run_checks(folder, "DD006", "DD001", "DD008")
    took = time.perf_counter() - t0
    assert [f.id for f in found] == ["DD006"]
    assert found[0].data["short"] == [77] and len(found[0].ranks) == 255
    assert "ranks 0-76,78-255: 12 steps" in found[0].message and "rank 77: 11 steps" in found[0].message
    assert took < 10, took


def _loop_run(tmp_path, src, loop: str):
    """Rank 0 runs 5 steps of the loop at line 28 of ``src`` (its step at line 30), rank 1 runs 4
    and leaves it normally."""
    step = (str(src), 30, "loss = model(x)", [[str(src), 28, loop, "for"]])
    long = [coll(1, "ddp_init", (str(src), 20)), ddp_record()] + ddp_steps(4, site=step)
    long += [{"t": "e", "op": "ddp_forward", "g": "0", "s": 0, "d": 5, "site": step, "grad": 1}]
    short = [coll(1, "ddp_init", (str(src), 20)), ddp_record()] + ddp_steps(4, site=step)
    return write_run(tmp_path / "run", {0: long, 1: short},
                     exits={0: raised(GLOO_CLOSED, line=31, inflight=[["ddp_backward", "0", 6, step, 99000]])})


def test_conditional_exits_of_the_loop_are_named_when_the_short_rank_left_it(tmp_path):
    """Early stopping on a rank's own loss: the short rank exited normally, and the loop's
    conditional exits (read from the source file) are named; an exit under no condition is not."""
    src = tmp_path / "train.py"
    src.write_text("import torch\n" * 27 + "for x in batches:\n"  # line 28
                   "    pass\n"
                   "    loss = model(x)\n"  # line 30
                   "    if loss.item() < best:\n"
                   "        break\n"
                   "    for y in inner:\n"
                   "        break\n")  # an inner loop's break is not an exit of this loop
    (f,) = run_checks(_loop_run(tmp_path, src, "for x in batches:"), "DD006")
    assert "conditional exits (train.py:32 `break` under train.py:31 `if loss.item() < best:`)" in f.message
    assert "if rank 1 took one" in f.message and "all-reduced or broadcast" in f.message
    assert {(loc.role, loc.line, loc.rank) for loc in f.locations} >= {("condition", 31, 1), ("exit", 32, 1)}
    assert not any(loc.line == 34 for loc in f.locations)


def test_no_exit_list_when_the_loop_has_no_conditional_exit(tmp_path):
    src = tmp_path / "train.py"
    src.write_text("import torch\n" * 27 + "for x in batches:\n    pass\n    loss = model(x)\n")
    step = (str(src), 30, "loss = model(x)", [[str(src), 28, "for x in batches:", "for"]])
    long = [coll(1, "ddp_init", (str(src), 20)), ddp_record()] + ddp_steps(5, site=step)
    short = [coll(1, "ddp_init", (str(src), 20)), ddp_record()] + ddp_steps(4, site=step)
    folder = write_run(tmp_path / "run", {0: long, 1: short})
    (f,) = run_checks(folder, "DD006")
    assert "conditional exits" not in f.message
    assert {loc.role for loc in f.locations} == {"call", "loop"}


def _sampler(num_samples: int, line: int, epoch: int = 0) -> dict:
    return {"t": "sampler", "id": line, "epoch": epoch, "seed": 0, "shuffle": False, "n": 2 * num_samples,
            "num_samples": num_samples, "total": 2 * num_samples, "replicas": 2, "srank": 0,
            "drop_last": False, "fp": "f", "data_fp": None, "created": ("train.py", line), "site": ("train.py", line)}


def test_sampler_hint_compares_each_sampler_with_itself(tmp_path):
    """A training sampler (128 a rank) and a validation one (32 a rank): the rank that stopped
    early last drew from the validation sampler; the note must not compare 128 with 32."""
    folder = uneven_run(tmp_path, extra={0: [_sampler(32, 12), _sampler(128, 11)],
                                         1: [_sampler(128, 11), _sampler(32, 12)]})
    f = run_checks(folder, "DD006")[0]
    assert "Samples per rank" not in f.message
    assert "gives every rank the same number of samples" in f.message


def test_sampler_hint_names_the_uneven_sampler(tmp_path):
    folder = uneven_run(tmp_path, extra={0: [_sampler(33, 12), _sampler(128, 11)],
                                         1: [_sampler(32, 12), _sampler(128, 11)]})
    f = run_checks(folder, "DD006")[0]
    assert "Samples per rank from the DistributedSampler created at train.py:12: rank 0: 33, rank 1: 32." in f.message


def test_an_exit_on_this_ranks_own_data_is_named_first_with_why(tmp_path):
    """Two exits: one on the epoch count (the same everywhere), one on a validation loss computed
    from a DistributedSampler's shard (source/shards.py): the second is listed first, with why."""
    src = tmp_path / "train.py"
    src.write_text("from torch.utils.data import DataLoader, DistributedSampler\n"
                   "val = DataLoader(vs, sampler=DistributedSampler(vs))\n"
                   + "import torch\n" * 25 + "for epoch in range(99):\n"  # line 28
                   "    pass\n"
                   "    loss = model(x)\n"  # line 30
                   "    if epoch > 90:\n"
                   "        break\n"
                   "    v = sum(float(b) for b in val)\n"
                   "    if v < best:\n"  # line 34
                   "        break\n")
    (f,) = run_checks(_loop_run(tmp_path, src, "for epoch in range(99):"), "DD006")
    assert ("conditional exits (train.py:35 `break` under train.py:34 `if v < best:`, which depends on the rank "
            "through this rank's own share of the data (`DistributedSampler`, line 2); train.py:32 `break` under "
            "train.py:31 `if epoch > 90:`)") in " ".join(f.message.split())
