"""`ddpdoctor lint` reads a helper's communication for the constants a call gives it
(lint/callconsts.py): YOLOv5's `create_dataloader(..., rank=-1)` on rank 0 enters
`torch_distributed_zero_first(-1)`, which issues no barrier, so calling it on one rank only is no
divergence; the same helper given the rank still is."""

from __future__ import annotations

import ast
import textwrap

from ddpdoctor.lint.config import LintConfig
from ddpdoctor.lint.engine import lint_modules
from ddpdoctor.source.consts import decide
from ddpdoctor.source.units import Module

SRC = """\
import os
from contextlib import contextmanager
import torch.distributed as dist

LOCAL_RANK = int(os.getenv("LOCAL_RANK", -1))
RANK = int(os.getenv("RANK", -1))


@contextmanager
def zero_first(local_rank: int):
    if local_rank not in [-1, 0]:
        dist.barrier()
    yield
    if local_rank == 0:
        dist.barrier()


def make_loader(path, rank=-1, workers=8):
    with zero_first(rank):
        data = open(path).read()
    return data


def main():
    train = make_loader("train.txt", rank=LOCAL_RANK)
    if RANK in {-1, 0}:
        val = CALL
    dist.barrier()
"""


def found(call: str) -> list[tuple[str, str, int]]:
    src = textwrap.dedent(SRC).replace("CALL", call)
    findings, notes, _n = lint_modules([Module("y.py", src)], LintConfig())
    assert not notes, notes
    return [(f.id, f.severity, f.locations[0].line) for f in findings]


def test_a_helper_given_constants_that_skip_its_collectives_does_not_communicate():
    assert found('make_loader("val.txt", rank=-1)') == []
    assert found('make_loader("val.txt")') == []  # the default, -1
    assert found('make_loader("val.txt", -1, 4)') == []


def test_the_same_helper_given_the_rank_or_zero_still_communicates():
    assert [f[:2] for f in found('make_loader("val.txt", rank=LOCAL_RANK)')] == [("DD001", "error")]
    assert [f[:2] for f in found('make_loader("val.txt", rank=0)')] == [("DD001", "error")]


def test_decide_reads_only_constants_and_literals():
    def d(expr: str, **consts):
        return decide(ast.parse(expr, mode="eval").body, consts)

    assert d("r not in [-1, 0]", r=-1) is False and d("r == 0", r=0) is True
    assert d("r == 0 or x", r=0) is True and d("r == 0 and x", r=1) is False
    assert d("r == 0 and x", r=0) is None and d("x == 0", r=0) is None
    assert d("not r", r=None) is True and d("r", r="") is False
    assert d("0 <= r < 4", r=2) is True and d("r in {1, 2}", r=3) is False
    assert d("r < 'a'", r=1) is None  # a comparison that would raise: undecided
