"""DD001 divergent-collectives and DD002 collective-mismatch: unit tests on hand-written traces
and their bad/good examples end to end."""

from __future__ import annotations

import pytest
from conftest import ROOT, findings_json, torchrun, trace
from support.tracekit import coll, run_check, write_traces

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


@pytest.mark.parametrize("category", ["divergent-collectives", "collective-mismatch"])
def test_examples_end_to_end(tmp_path, category):
    folder = ROOT / "checks" / category
    bad = trace(torchrun(folder / "bad.py"), tmp_path / "bad", "--hang-timeout", "5", "--on-hang", "kill",
                timeout=90, env={"EXAMPLE_PG_TIMEOUT": "60"})
    assert bad.returncode != 0
    doc = findings_json(tmp_path / "bad")
    found = [f for f in doc["findings"] if f["category"] == category]
    assert found and found[0]["severity"] == "error", [f["message"] for f in doc["findings"]]
    src = (folder / "bad.py").read_text().splitlines()
    bug_lines = {i for i, line in enumerate(src, 1) if "# the bug" in line or "# the step's" in line}
    assert bug_lines & {loc["line"] for loc in found[0]["locations"]}, found[0]["locations"]
    good = trace(torchrun(folder / "good.py"), tmp_path / "good", "--hang-timeout", "5", timeout=90)
    assert good.returncode == 0, good.stderr[-2000:]
    gdoc = findings_json(tmp_path / "good")
    assert not [f for f in gdoc["findings"] if f["severity"] == "error"], gdoc["findings"]


def test_loop_exits_and_loop_left(tmp_path):
    from ddpdoctor.trace.sourceinfo import conditions_for_stack, loop_exits, loop_left

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
    inside = conditions_for_stack([(str(src), 6)])
    outside = conditions_for_stack([(str(src), 9)])
    found = loop_left(inside, outside)
    assert found["line"] == 2 and found["exits"] == exits
    assert loop_left(outside, inside) is None


def test_divergent_example_blames_the_rank_that_left_the_loop(tmp_path):
    res = trace(torchrun(ROOT / "checks" / "divergent-collectives" / "bad.py"), tmp_path / "t", "--hang-timeout",
                "5", "--on-hang", "kill", timeout=90, env={"EXAMPLE_PG_TIMEOUT": "60"})
    assert res.returncode == 124
    f = [f for f in findings_json(tmp_path / "t")["findings"] if f["category"] == "divergent-collectives"][0]
    assert f["ranks"] == [0]
    assert {"condition", "exit", "loop"} <= {loc["role"] for loc in f["locations"]}
    assert "it left the loop at bad.py:20" in res.stderr  # the live diagnosis says it too


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
