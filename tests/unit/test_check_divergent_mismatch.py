"""DD001 divergent-collectives and DD002 collective-mismatch: unit tests on hand-written traces
(their bad/good examples run end to end in tests/e2e)."""

from __future__ import annotations

from support.traces import group_coll as coll
from support.traces import run_check, write_traces

from ddpdoctor.analysis.checks.collective_mismatch import CollectiveMismatch
from ddpdoctor.analysis.checks.divergent_collectives import DivergentCollectives

COND = [["train.py", 9, "if rank == 0:", "if"]]


def test_majority_names_the_minority(tmp_path):
    ranks = {r: [coll("0", 1, "all_reduce"), coll("0", 2, "barrier", site=("train.py", 20))] for r in range(4)}
    ranks[2][1] = coll("0", 2, "all_reduce", site=("train.py", 12))
    findings = run_check(DivergentCollectives, write_traces(tmp_path, ranks))
    assert len(findings) == 1
    f = findings[0]
    assert f.ranks == [2] and f.data["culprit"] == [2] and f.data["seq"] == 2
    assert {(loc.rank, loc.line) for loc in f.locations} >= {(2, 12), (0, 20)}


def test_tie_uses_the_rank_dependent_condition(tmp_path):
    folder = write_traces(tmp_path, {
        0: [coll("0", 1), coll("0", 2, "all_reduce", site=("train.py", 10, "dist.all_reduce(x)"))],
        1: [coll("0", 1), coll("0", 2, "barrier", site=("train.py", 12, "dist.barrier()"))],
    })
    # give rank 0's site the enclosing `if rank == 0:` the recorder would have found
    path = next(folder.glob("rank00000-*.jsonl"))
    text = path.read_text().replace('"src": "dist.all_reduce(x)"', '"src": "dist.all_reduce(x)", "conds": '
                                    + __import__("json").dumps(COND))
    path.write_text(text)
    f = run_check(DivergentCollectives, folder)[0]
    assert f.data["culprit"] == [0]
    assert any(loc.role == "condition" and loc.line == 9 for loc in f.locations)


def test_tie_without_evidence_names_no_culprit(tmp_path):
    folder = write_traces(tmp_path, {0: [coll("0", 1, "all_reduce")], 1: [coll("0", 1, "broadcast")]})
    f = run_check(DivergentCollectives, folder)[0]
    assert f.data["culprit"] == [] and sorted(f.ranks) == [0, 1]


def test_groups_are_aligned_separately(tmp_path):
    # rank 1 runs more collectives in its own subgroup "5": not a divergence of group 0
    folder = write_traces(tmp_path, {
        0: [coll("0", 1), coll("0", 2)],
        1: [coll("0", 1), coll("5", 1, "all_reduce"), coll("5", 2, "all_reduce"), coll("0", 2)],
    })
    assert run_check(DivergentCollectives, folder) == []


def test_agreeing_long_sequences_are_silent(tmp_path):
    ranks = {r: [coll("0", s, "all_reduce" if s % 3 else "barrier") for s in range(1, 1200)] for r in range(3)}
    assert run_check(DivergentCollectives, write_traces(tmp_path, ranks)) == []


def test_mismatch_in_a_late_block(tmp_path):
    ranks = {r: [coll("0", s, "all_reduce", x=["float32[4]"], rop="SUM") for s in range(1, 700)] for r in range(2)}
    ranks[1][600] = coll("0", 601, "all_reduce", x=["float32[4]"], rop="MAX", site=("train.py", 33))
    findings = run_check(CollectiveMismatch, write_traces(tmp_path, ranks))
    assert len(findings) == 1 and findings[0].data["seq"] == 601
    assert "reduce op" in findings[0].message and "MAX" in findings[0].message


def test_asymmetric_ops_are_not_compared(tmp_path):
    folder = write_traces(tmp_path, {
        0: [coll("0", 1, "all_to_all_single", x=["float32[3]"])],
        1: [coll("0", 1, "all_to_all_single", x=["float32[5]"])],
    })
    assert run_check(CollectiveMismatch, folder) == []


def test_loop_exits_and_loop_left(tmp_path):
    from ddpdoctor.trace.sourceinfo import loop_exits
    from ddpdoctor.verdict.blame import left_loops

    src = tmp_path / "train.py"
    src.write_text(
        "def train(loader, rank):\n"
        "    for step, x in enumerate(loader):\n"
        "        for micro in x:\n"
        "            if micro is None:\n"
        "                break\n"                       # inner loop's break: not an exit of the outer
        "        sync(x)\n"
        "        if local_loss(x) < 0.1:\n"
        "            break\n"
        "    finish()\n")
    exits = loop_exits(str(src), 2)
    assert exits == [[8, "break", 7, "if local_loss(x) < 0.1:"]]
    inside = {"stack": [[str(src), 6, "train", "sync(x)"]]}
    outside = {"stack": [[str(src), 9, "train", "finish()"]]}
    found = list(left_loops({"in": inside, "out": outside}))
    assert len(found) == 1
    k, k2, loop, guarded = found[0]
    assert (k, k2) == ("in", "out") and loop["line"] == 2 and loop["exits"] == exits and guarded == exits


def test_mismatch_when_every_rank_died_inside_the_call(tmp_path):
    """gloo aborts one rank inside a mismatched all_reduce and the launcher ends the other: no
    rank completed it; the calls come from the in-flight records (as `pending`)."""
    def pending(x):
        return {"t": "pending", "op": "all_reduce", "g": "0", "s": 1, "x": [x], "rop": "SUM",
                "site": ("bad.py", 22), "src": "inflight"}

    folder = write_traces(tmp_path, {0: [pending("float32[1000]")], 1: [pending("float32[999]")]})
    findings = run_check(CollectiveMismatch, folder)
    assert len(findings) == 1 and findings[0].data["seq"] == 1
    assert "float32[1000]" in findings[0].message and "float32[999]" in findings[0].message


def test_a_culprit_in_a_ddp_forward_gets_the_model_module_fix(tmp_path):
    """Rank-0-only evaluation through the DDP model: its forward broadcasts buffers."""
    ranks = {r: [coll("0", 1, "all_reduce"), coll("0", 2, "barrier", site=("train.py", 20))] for r in range(3)}
    ranks[0][1] = coll("0", 2, "ddp_forward", site=("train.py", 15, "val = model(x)"))
    f = run_check(DivergentCollectives, write_traces(tmp_path / "a", ranks))[0]
    assert f.data["culprit"] == [0] and "model.module(x)" in f.fix
    # any other culprit op keeps the general fix
    ranks[0][1] = coll("0", 2, "all_reduce", site=("train.py", 15))
    f = run_check(DivergentCollectives, write_traces(tmp_path / "b", ranks))[0]
    assert f.data["culprit"] == [0] and "model.module" not in f.fix and f.fix == DivergentCollectives.fix
