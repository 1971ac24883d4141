"""`ddpdoctor lint` on conditional expressions (`a() if cond else b()`): a collective on one side
under a rank-dependent test is a divergent branch, as in an `if` statement; the same collective
on both sides, or a test that is the same on every rank, is not."""

from __future__ import annotations

import textwrap

from ddpdoctor.lint.config import LintConfig
from ddpdoctor.lint.engine import lint_modules
from ddpdoctor.source.units import Module

HEAD = "import torch\nimport torch.distributed as dist\ndist.init_process_group('gloo')\nrank = dist.get_rank()\n"


def found(src: str) -> list[tuple[str, str, int]]:
    findings, notes, _n = lint_modules([Module("snippet.py", HEAD + textwrap.dedent(src))], LintConfig())
    assert not notes, notes
    return [(f.id, f.severity, f.locations[0].line - HEAD.count("\n")) for f in findings]


def test_a_collective_on_one_side_of_a_rank_dependent_conditional_expression():
    assert found("""\
        t = torch.ones(1)
        w = dist.all_reduce(t) if rank == 0 else None
        dist.barrier()
        """) == [("DD001", "error", 2)]
    # the collective on the false side, inside a function, returned
    assert found("""\
        def step(t):
            return None if dist.get_rank() != 0 else dist.broadcast(t, src=0)
        step(torch.ones(1))
        """) == [("DD001", "error", 2)]


def test_the_same_collective_on_both_sides_or_a_uniform_test_is_silent():
    assert found("""\
        t = torch.ones(1)
        w = dist.broadcast(t, src=0) if rank == 0 else dist.broadcast(t, src=0)
        step = 3
        v = dist.all_reduce(t) if step % 2 else dist.barrier()
        """) == []


def test_a_conditional_expression_matching_an_if_statement_on_the_other_ranks_is_silent():
    """Ranks 0 and 2 create the group in a conditional expression, the others in an `if`: every
    rank issues new_group once, at step 0."""
    assert found("""\
        for step in range(3):
            if rank in (0, 2):
                leaders = dist.new_group([0, 2]) if step == 0 else leaders
            else:
                if step == 0:
                    dist.new_group([0, 2])
        """) == []
