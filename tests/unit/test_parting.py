"""Where the ranks' control flow parted (verdict/parting.py), judged from their stacks and the
shared rank-dependence analysis (verdict/rankdep.py, faked here), never from words (issue 15).

Also: same op from different call sites (a user's barrier paired with a framework's), one finding
per site with a count, nanoGPT's optimizer built before DDP, a peeked sampler, library per-item seeds."""

from __future__ import annotations

import textwrap

import pytest
from support.traces import run_check, run_checks, write_rank, write_traces

from ddpdoctor.analysis.checks.divergent_collectives import DivergentCollectives
from ddpdoctor.analysis.checks.unseeded_rng import UnseededRng
from ddpdoctor.analysis.findings import Finding, Location
from ddpdoctor.analysis.grouping import group_repeats
from ddpdoctor.trace import records
from ddpdoctor.verdict import blame, parting, rankdep

NANOGPT = textwrap.dedent('''\
    import torch.distributed as dist

    def estimate_loss():
        out = {}
        for split in ["train", "val"]:  # rank 0 only? no: every rank that gets here
            mean = loss()
            dist.all_reduce(mean)
            out[split] = mean
        return out

    while True:
        if iter_num % eval_interval == 0 and master_process:
            losses = estimate_loss()
        logits, loss = model(X, Y)
        loss.backward()
    ''')


class FakeVerdict:
    def __init__(self, state):
        self.state, self.reason, self.sure = state, "fake", True


class FakeLint:
    """A stand-in for ddpdoctor.lint.rankdep: before :meth:`add`, no analysis (``unknown``); then a
    condition is rank-dependent when its code (comments stripped) names one of the names added."""

    def __init__(self) -> None:
        self.names: set[str] = set()
        rankdep.set_backend(self)

    def __call__(self, source: str, lineno: int, filename: str):
        if not self.names:
            return FakeVerdict("unknown")
        line = source.splitlines()[lineno - 1].split("#")[0]
        return FakeVerdict("yes" if any(n in line for n in self.names) else "no")

    def add(self, name: str) -> None:
        self.names.add(name)
        rankdep.set_backend(self)  # forgets what was judged before


@pytest.fixture
def fake_lint():
    yield FakeLint()
    rankdep.set_backend(None)


def site(*frames, via=None) -> dict:
    """A site record from frames given innermost first: (file, line, func)."""
    stack = [[f, ln, fn, ""] for f, ln, fn in frames]
    return {"t": "site", "file": stack[0][0], "line": stack[0][1], "func": stack[0][2], "stack": stack,
            **({"via": via} if via else {})}


def test_the_branch_where_the_ranks_parted_not_a_loop_in_a_deeper_frame(tmp_path):
    """nanoGPT: rank 0 waits in estimate_loss()'s all_reduce (inside `for split in ...`), reached
    through `if ... and master_process:`; rank 1 is at the DDP backward. The guard is the branch,
    the loop of the deeper frame is not (it was blamed as "different data lengths")."""
    f = tmp_path / "train.py"
    f.write_text(NANOGPT)
    rank0 = site((str(f), 7, "estimate_loss"), (str(f), 13, "<module>"))
    rank1 = site((str(f), 15, "<module>"))
    found = parting.branches(rank0, [rank1])
    assert [(b.line, b.observed) for b in found] == [(5, False), (12, True)]
    decided = parting.deciding(found)
    assert decided is not None and decided.line == 12 and decided.observed  # seen, no analysis needed
    assert blame.conditioned_side({"all_reduce": rank0, "ddp_backward": rank1}) == "all_reduce"
    assert list(blame.left_loops({"all_reduce": rank0, "ddp_backward": rank1})) == []


def test_comments_and_spelling_never_count(tmp_path, fake_lint):
    """Of the branches the ranks were seen to part at, the one whose condition the analysis finds
    rank-dependent is named; a comment that says `rank` makes nothing rank-dependent."""
    f = tmp_path / "train.py"
    f.write_text(textwrap.dedent('''\
        def step(x, master):
            for i in range(3):  # rank 0 logs here
                if master:
                    if x.sum() > 0:  # is_main_process?
                        barrier()
            all_reduce(x)
        '''))
    inside = site((str(f), 5, "step"))
    outside = site((str(f), 6, "step"))
    found = parting.branches(inside, [outside])
    assert [(b.line, b.kind, b.observed) for b in found] == [(4, "if", True), (3, "if", True), (2, "for", True)]
    assert parting.deciding(found).line == 4  # no analysis: the innermost `if` they parted at
    fake_lint.add("master")
    assert parting.deciding(parting.branches(inside, [outside])).line == 3
    assert not [b for b in parting.branches(inside, [outside]) if b.kind == "for" and b.rank_dependent]


def test_a_user_hook_only_one_rank_entered_is_judged_by_the_analysis(tmp_path, fake_lint):
    """Lightning: rank 0's barrier is in the user's setup() hook (called by the framework) under
    `if self.trainer.is_global_zero:`; rank 1's barrier is the framework's own, from the same
    trainer.fit line. No frame where both are: the analysis decides."""
    f = tmp_path / "model.py"
    f.write_text(textwrap.dedent('''\
        class M:
            def setup(self, stage):
                if DEBUG:
                    pass
                if self.trainer.is_global_zero:
                    self.trainer.strategy.barrier()

        trainer.fit(M())
        '''))
    user = site((str(f), 6, "setup"), (str(f), 8, "<module>"), via="lightning barrier (ddp.py:303)")
    framework = site((str(f), 8, "<module>"), via="lightning fit (trainer.py:584)")
    assert parting.deciding(parting.branches(user, [framework])) is None  # no analysis: unknown
    fake_lint.add("is_global_zero")
    b = parting.deciding(parting.branches(user, [framework]))
    assert b is not None and b.line == 5 and not b.observed


def _sites_file(tmp_path, fake_lint):
    f = tmp_path / "model.py"
    f.write_text("class M:\n    def setup(self):\n        if self.trainer.is_global_zero:\n"
                 "            barrier()\n\ntrainer.fit(M())\n")
    fake_lint.add("is_global_zero")
    return str(f)


def test_same_op_from_different_sites_is_where_the_ranks_parted(tmp_path, fake_lint):
    f = _sites_file(tmp_path, fake_lint)
    fit = records.site(1, f, 6, "<module>", "trainer.fit(M())", stack=[[f, 6, "<module>", "trainer.fit(M())"]],
                       via="lightning fit (trainer.py:584)")
    hook = records.site(2, f, 4, "setup", "barrier()", stack=[[f, 4, "setup", "barrier()"], [f, 6, "<module>", ""]],
                        via="lightning barrier (ddp.py:303)")

    def c(s, op, sid):
        return {"t": "c", "op": op, "g": "0", "s": s, "ts": 100 * s, "d": 1, "site": sid}

    write_rank(tmp_path / "t", 0, 2, [fit, hook, c(1, "broadcast", 1), c(2, "barrier", 1), c(3, "barrier", 2),
                                      c(4, "barrier", 1)])
    write_rank(tmp_path / "t", 1, 2, [fit, c(1, "broadcast", 1), c(2, "barrier", 1), c(3, "barrier", 1),
                                      c(4, "ddp_init", 1)])
    found = run_check(DivergentCollectives, tmp_path / "t")
    assert len(found) == 1
    fd = found[0]
    assert fd.data["seq"] == 3 and fd.data["diverged_at"] == 4 and fd.data["culprit"] == [0]
    roles = {(loc.role, loc.line) for loc in fd.locations}
    assert ("call", 4) in roles and ("condition", 3) in roles
    assert "is_global_zero" in fd.message and "different call sites" in fd.message


def test_different_sites_without_a_rank_dependent_side_change_nothing(tmp_path, fake_lint):
    """`if rank == 0: broadcast(x) else: broadcast(y)` style pairs are correct: no earlier parting."""
    f = tmp_path / "p.py"
    f.write_text("if flag:\n    broadcast(x)\nelse:\n    broadcast(y)\nbarrier()\n")
    a = records.site(1, str(f), 2, "<module>", "broadcast(x)")
    b = records.site(2, str(f), 4, "<module>", "broadcast(y)")
    ok = records.site(3, str(f), 5, "<module>", "barrier()")

    def c(s, op, sid):
        return {"t": "c", "op": op, "g": "0", "s": s, "ts": 100 * s, "d": 1, "site": sid}

    write_rank(tmp_path / "t", 0, 2, [a, b, ok, c(1, "broadcast", 1), c(2, "barrier", 3)])
    write_rank(tmp_path / "t", 1, 2, [a, b, ok, c(1, "broadcast", 2), c(2, "barrier", 3)])
    assert run_checks(tmp_path / "t") == []


def test_the_same_finding_per_call_is_shown_once_with_a_count():
    def f(rank):
        return Finding("DD004", "unseeded-rng", "info", "Rank-dependent random seed", "seeded", [rank],
                       [Location(rank, "data.py", 12, "", "", "seed")])

    other = Finding("DD004", "unseeded-rng", "info", "Rank-dependent random seed", "x", [0],
                    [Location(0, "data.py", 40, "", "", "seed")])
    out = group_repeats([f(0), f(1), f(0), other])
    assert len(out) == 2 and out[0].data["repeats"] == 3 and out[0].ranks == [0, 1]
    assert "3 times" in out[0].message and "repeats" not in out[1].data


def test_optimizer_built_before_ddp_wrapping_is_no_model_init_finding(tmp_path):
    """nanoGPT builds the optimizer, then wraps the model in DDP (which broadcasts rank 0's
    weights into the same parameters); a run that dies before the first step() has only the
    `init` records, with in_ddp 0."""
    def optim(fp):
        return {"t": "optim", "at": "init", "id": 9, "cls": "AdamW", "nparams": 3, "fp": fp, "in_ddp": 0,
                "site": ("train.py", 50)}

    def ddp(fp):
        return {"t": "ddp", "g": "0", "s": 1, "site": ("train.py", 52), "nparams": 3, "names": "n",
                "init_fp": fp, "nbuffers": 0, "broadcast_buffers": True, "find_unused": False, "params": []}

    wrapped = {r: [optim(f"p{r}"), ddp(f"p{r}")] for r in (0, 1)}
    assert [x.data.get("what") for x in run_check(UnseededRng, write_traces(tmp_path / "a", wrapped))] == []
    never = {r: [optim(f"p{r}")] for r in (0, 1)}  # never wrapped: the ranks do start apart
    assert [x.data.get("what") for x in run_check(UnseededRng, write_traces(tmp_path / "b", never))] == \
        ["model-init"]


def test_library_per_item_seeds_are_no_finding(tmp_path):
    """torchvision's FakeData seeds torch per sample inside __getitem__: library code (the site has
    `via`), many times per rank. Not a rank-dependent seed; a user's seed still is (once)."""
    lib = records.site(1, "/w/train.py", 30, "main", "for x, y in loader:", via="torchvision __getitem__ (fakedata.py:50)")
    user = records.site(2, "/w/train.py", 10, "main", "torch.manual_seed(rank)")

    def seeds(rank):
        return [{"t": "seed", "gen": "torch", "value": 2 * i + rank, "ts": 10 + i, "site": 1} for i in range(50)]

    for r in (0, 1):
        write_rank(tmp_path / "t", r, 2, [lib, user, {"t": "seed", "gen": "torch", "value": r, "ts": 1, "site": 2},
                                          *seeds(r)])
    found = run_check(UnseededRng, tmp_path / "t")
    assert [(x.data.get("what"), x.locations[0].line) for x in found] == [("seed", 10)]


def test_where_the_other_rank_was_before_shows_the_branch_it_skipped(tmp_path):
    """A test under `ddpdoctor.check()`: rank 1 left the test function (its next call is the
    check's end, made by the test runner, no user frame) while rank 0 calls line 4 under an `if`.
    Both made their previous call at line 2 of the same function: rank 1 skipped the `if`. Seen,
    without any analysis of the condition."""
    f = tmp_path / "test_x.py"
    f.write_text("def test_hangs():\n    all_reduce(x)\n    if flag():\n        all_reduce(x)\n")
    rank0 = site((str(f), 4, "test_hangs"))
    rank1 = site(("/venv/lib/site-packages/pluggy/_callers.py", 121, "_multicall"))
    rank1_before = site((str(f), 2, "test_hangs"))
    assert parting.deciding(parting.branches(rank0, [rank1])) is None
    b = parting.deciding(parting.branches(rank0, [rank1], [rank1_before]))
    assert b is not None and b.line == 3 and b.observed
    assert blame.conditioned_side({"all_reduce": rank0, "check_end": rank1},
                                  {"all_reduce": rank1_before, "check_end": rank1_before}) == "all_reduce"
