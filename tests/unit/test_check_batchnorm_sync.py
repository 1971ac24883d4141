"""batchnorm-sync (DD014) on hand-written traces."""

from __future__ import annotations

from support.traces import run_check, write_traces

from ddpdoctor.analysis.checks.batchnorm_sync import BatchnormSync


def layers(bn: int = 2, sbn: int = 0, dev: str = "cuda") -> dict:
    return {"t": "bn", "op": "layers", "id": 0, "bn": bn, "sbn": sbn, "dev": dev, "site": ("train.py", 20)}


def batch(n: int) -> dict:
    return {"t": "bn", "op": "batch", "id": 0, "n": n, "site": ("train.py", 30)}


def test_conversion_after_wrapping_is_an_error(tmp_path):
    conv = {"t": "bn", "op": "convert", "id": 0, "site": ("train.py", 21)}
    found = run_check(BatchnormSync, write_traces(tmp_path, {0: [layers(), conv], 1: [layers(), conv]}))
    assert [(f.severity, f.data["op"]) for f in found] == [("error", "convert")]
    assert found[0].locations[0].line == 21


def test_small_per_rank_batch_without_syncbn_is_info_with_the_sizes(tmp_path):
    found = run_check(BatchnormSync, write_traces(tmp_path, {0: [layers(), batch(4)], 1: [layers(), batch(3)]}))
    assert [f.severity for f in found] == ["info"]
    assert "rank 0: 4; rank 1: 3" in found[0].message and found[0].data["batch"] == {0: 4, 1: 3}


def test_small_batches_on_cpu_are_silent(tmp_path):
    # DDP refuses SyncBatchNorm for CPU modules: nothing to advise
    assert run_check(BatchnormSync, write_traces(tmp_path, {0: [layers(dev="cpu"), batch(4)],
                                                            1: [layers(dev="cpu"), batch(4)]})) == []


def test_large_batches_or_syncbn_are_silent(tmp_path):
    assert run_check(BatchnormSync, write_traces(tmp_path / "a", {0: [layers(), batch(64)],
                                                                  1: [layers(), batch(64)]})) == []
    assert run_check(BatchnormSync, write_traces(tmp_path / "b", {0: [layers(0, 2), batch(4)],
                                                                  1: [layers(0, 2), batch(4)]})) == []


def test_checkpoint_with_one_ranks_statistics_is_info(tmp_path):
    def rep(at, step, b):
        r = {"t": "replica", "id": 0, "at": at, "step": step, "fp": "p", "bfp": "|".join(b), "p": ["a"],
             "b": list(b), "pv": [1], "bv": [1, 1], "site": ("train.py", 40)}
        if at == "init":
            r.update(names=["0.weight"], bnames=["1.running_mean", "1.running_var"], bb=True)
        return r

    r0 = [layers(), batch(64), rep("init", 0, ["m", "v"]), rep("step", 3, ["m0", "v0"]), rep("save", 3, ["m0", "v0"])]
    r1 = [layers(), batch(64), rep("init", 0, ["m", "v"]), rep("step", 3, ["m1", "v1"])]
    found = run_check(BatchnormSync, write_traces(tmp_path, {0: r0, 1: r1}))
    assert [(f.severity, f.data.get("saver")) for f in found] == [("info", 0)]
    assert "1.running_mean" in found[0].message
