"""replica-drift (DD013) on hand-written traces: digests of DDP replicas compared per step."""

from __future__ import annotations

from support.traces import run_check, write_traces

from ddpdoctor.analysis.checks.replica_drift import ReplicaDrift

NAMES = ["0.weight", "0.bias", "2.weight", "2.bias"]


def rep(at: str, step: int, p: list[str], pv: list[int], b=("b0",), bv=(1,), line: int = 30, **extra) -> dict:
    rec = {"t": "replica", "id": 0, "at": at, "step": step, "fp": "|".join(p), "bfp": "|".join(b), "p": list(p),
           "b": list(b), "pv": list(pv), "bv": list(bv), "site": ("train.py", line)}
    if at == "init":
        rec.update(names=NAMES, bnames=["1.running_mean"], bb=extra.pop("bb", True))
    rec.update(extra)
    return rec


SAME = ["a", "b", "c", "d"]


def steps(values: list[list[str]], versions: list[list[int]], bb: bool = True, bufs=None) -> list[dict]:
    out = [rep("init", 0, SAME, [1, 1, 1, 1], line=20, bb=bb)]
    for i, (p, v) in enumerate(zip(values, versions), 1):
        b = bufs[i - 1] if bufs else ("b0",)
        out.append(rep("step", i, p, v, b=b))
    return out


def test_identical_replicas_are_silent(tmp_path):
    vals = [["a1", "b1", "c1", "d1"], ["a2", "b2", "c2", "d2"]]
    vers = [[2, 2, 2, 2], [3, 3, 3, 3]]
    folder = write_traces(tmp_path, {0: steps(vals, vers), 1: steps(vals, vers)})
    assert run_check(ReplicaDrift, folder) == []


def test_in_place_edit_on_one_rank_is_named_with_the_first_step(tmp_path):
    ok = steps([["a1", "b1", "c1", "d1"], ["a2", "b2", "c2", "d2"]], [[2, 2, 2, 2], [3, 3, 3, 3]])
    odd = steps([["a1", "b1", "c1", "d1"], ["a2", "b2", "cX", "d2"]], [[2, 2, 2, 2], [3, 3, 4, 3]])
    found = run_check(ReplicaDrift, write_traces(tmp_path, {0: ok, 1: odd}))
    assert len(found) == 1
    f = found[0]
    assert (f.severity, f.ranks, f.data["step"], f.data["names"]) == ("error", [1], 2, ["2.weight"])
    assert "in-place write" in f.message and "after step 1" in f.message


def test_load_on_one_rank_is_the_cause(tmp_path):
    ok = steps([["a1", "b1", "c1", "d1"]], [[2, 2, 2, 2]])
    odd = [ok[0], {"t": "replica_w", "id": 0, "how": "load", "step": 0, "site": ("train.py", 25)},
           rep("step", 1, ["x", "y", "z", "w"], [3, 3, 3, 3])]
    found = run_check(ReplicaDrift, write_traces(tmp_path, {0: ok, 1: odd, 2: ok}))
    assert len(found) == 1 and found[0].ranks == [1]
    assert "load_state_dict at train.py:25" in found[0].message
    assert ("write", 25) in {(loc.role, loc.line) for loc in found[0].locations}


def test_buffers_compared_only_without_broadcast(tmp_path):
    vals = [["a1", "b1", "c1", "d1"]]
    vers = [[2, 2, 2, 2]]
    r0 = steps(vals, vers, bufs=[("m0",)])
    r1 = steps(vals, vers, bufs=[("m1",)])
    assert run_check(ReplicaDrift, write_traces(tmp_path / "bb", {0: r0, 1: r1})) == []
    r0 = steps(vals, vers, bb=False, bufs=[("m0",)])
    r1 = steps(vals, vers, bb=False, bufs=[("m1",)])
    found = run_check(ReplicaDrift, write_traces(tmp_path / "nobb", {0: r0, 1: r1}))
    assert [(f.severity, f.data["what"]) for f in found] == [("warning", "buffers")]


def test_save_on_one_rank_is_compared_with_the_others_at_the_same_step(tmp_path):
    ok = steps([["a1", "b1", "c1", "d1"]], [[2, 2, 2, 2]])
    saver = ok + [rep("save", 1, ["a1", "b1", "cX", "d1"], [2, 2, 3, 2])]
    found = run_check(ReplicaDrift, write_traces(tmp_path, {0: saver, 1: ok, 2: ok}))
    assert len(found) == 1 and found[0].data["at"] == "save" and found[0].ranks == [0]


def test_different_models_are_not_compared(tmp_path):
    a = steps([["a1", "b1", "c1", "d1"]], [[2, 2, 2, 2]])
    b = [dict(a[0], names=["x"])] + [rep("step", 1, ["q"], [2])]
    assert run_check(ReplicaDrift, write_traces(tmp_path, {0: a, 1: b})) == []
