"""batchnorm-sync (DD014), train/eval mode: BatchNorm layers of a DDP module in different modes on
different ranks at the same gradient all-reduce. Hand-written ``bn`` ``mode`` records; the
programs run end to end in tests/e2e/test_rng_bn_runs.py."""

from __future__ import annotations

from support.traces import ddp_record, ddp_steps, run_check, write_traces

from ddpdoctor.analysis.checks.batchnorm_sync import BatchnormSync


def layers(bn: int = 1, sbn: int = 0) -> dict:
    return {"t": "bn", "op": "layers", "id": 0, "bn": bn, "sbn": sbn, "dev": "cpu", "site": ("train.py", 20)}


def mode(train: bool, bwd: int, at: str = "train", line: int = 40) -> dict:
    return {"t": "bn", "op": "mode", "id": 0, "at": at, "train": int(train), "of": 1,
            "fp": "t" if train else "e", "bwd": bwd, "fwd": bwd,
            "site": ("train.py", line, "model.train()" if train else "model.eval()")}


def run(tmp_path, ranks, sbn: int = 0):
    recs = {r: [layers(bn=0 if sbn else 1, sbn=sbn), mode(True, 0, "init", 20), *body] for r, body in ranks.items()}
    return run_check(BatchnormSync, write_traces(tmp_path / "t", recs))


def test_one_rank_left_in_eval_mode_is_an_error_at_the_first_step(tmp_path):
    found = run(tmp_path, {0: [mode(False, 4), mode(False, 12, "exit")], 1: [mode(True, 12, "exit")]})
    assert [(f.severity, f.data.get("op"), f.data.get("step")) for f in found] == [("error", "mode", 5)]
    f = found[0]
    assert "rank 0: eval mode" in f.message and "rank 1: train mode" in f.message
    assert [(loc.rank, loc.line, loc.role) for loc in f.locations] == [(0, 40, "mode")]
    assert "running statistics" in f.message


def test_rank0_only_evaluation_after_training_is_silent(tmp_path):
    found = run(tmp_path, {0: [mode(False, 12), mode(False, 12, "exit")], 1: [mode(True, 12, "exit")]})
    assert found == []


def test_rank0_only_evaluation_between_epochs_with_train_restored_is_silent(tmp_path):
    body0 = [mode(False, 4), mode(True, 4, line=30), mode(False, 8), mode(True, 8, line=30), mode(True, 12, "exit")]
    assert run(tmp_path, {0: body0, 1: [mode(True, 12, "exit")]}) == []


def test_the_same_change_on_every_rank_is_silent(tmp_path):
    # frozen BatchNorm for fine-tuning, on every rank
    assert run(tmp_path, {r: [mode(False, 3, line=33), mode(False, 9, "exit")] for r in (0, 1)}) == []


def test_without_exit_records_the_steps_come_from_the_ddp_backwards(tmp_path):
    def body(n, odd):
        return [ddp_record(), *ddp_steps(n)] + ([mode(False, 3)] if odd else [])

    assert run(tmp_path / "a", {0: body(3, True), 1: body(3, False)}) == []  # no 4th step anywhere
    found = run(tmp_path / "b", {0: body(5, True), 1: body(5, False)})
    assert [f.data.get("step") for f in found] == [4]


def test_syncbatchnorm_message_names_its_collectives(tmp_path):
    found = run(tmp_path, {0: [mode(True, 12, "exit")], 1: [mode(False, 0), mode(False, 12, "exit")]}, sbn=2)
    assert [f.data.get("step") for f in found] == [1]
    assert found[0].ranks == [0, 1] and "SyncBatchNorm all-gathers" in found[0].message


def test_syncbatchnorm_stuck_in_the_step_after_the_last_backward_is_found(tmp_path):
    # no exit records (the job hung and was killed): the step after the last complete one counts
    # for SyncBatchNorm, whose forward all-gathers in train mode only; plain BatchNorm stays silent
    def body(odd, sbn):
        recs = [layers(bn=0 if sbn else 1, sbn=2 if sbn else 0), mode(True, 0, "init", 20), ddp_record(),
                *ddp_steps(3)]
        return recs + ([mode(False, 3)] if odd else [])

    found = run_check(BatchnormSync, write_traces(tmp_path / "a", {0: body(True, True), 1: body(False, True)}))
    assert [(f.data.get("op"), f.data.get("step")) for f in found] == [("mode", 4)]
    assert run_check(BatchnormSync, write_traces(tmp_path / "b", {0: body(True, False), 1: body(False, False)})) == []


def test_damaged_mode_records_give_no_traceback(tmp_path):
    junk = {"t": "bn", "op": "mode", "id": 0, "at": "train", "train": "x", "of": [1], "fp": [2], "bwd": "y",
            "site": ("train.py", 40)}
    found = run(tmp_path, {0: [junk, mode(True, 3, "exit")], 1: [mode(True, 3, "exit")]})
    assert [f.data.get("step") for f in found] == [1]  # junk counts as a change before step 1
