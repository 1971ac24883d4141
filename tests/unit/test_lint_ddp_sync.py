"""`ddpdoctor lint` DD005 (gradients of a DDP model all-reduced by hand) when DDP's own reduction
is switched off: the manual all-reduce is then the only one (custom gradient sync), not a second."""

from __future__ import annotations

import textwrap

from ddpdoctor.lint.config import LintConfig
from ddpdoctor.lint.engine import lint_modules
from ddpdoctor.source.units import Module

HEAD = ("import torch\nimport torch.distributed as dist\nimport torch.nn as nn\n"
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "model = DDP(nn.Linear(4, 1))\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n")


def ids(src: str) -> list[tuple[str, str]]:
    findings, notes, _n = lint_modules([Module("snippet.py", HEAD + textwrap.dedent(src))], LintConfig())
    assert not notes, notes
    return [(f.id, f.severity) for f in findings]


MANUAL = """\
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    opt.step()
"""


def step(body: str) -> str:
    """A function whose body is ``body`` (lines indented by 4) followed by the manual reduction."""
    return "def step(x, last):\n" + textwrap.indent(textwrap.dedent(body), "    ") + MANUAL


def test_backward_under_no_sync_then_a_manual_reduction_is_silent():
    assert ids(step("""\
        for micro in range(2):
            with model.no_sync():
                model(x).sum().backward()
        """)) == []


def test_reduction_switched_off_by_require_backward_grad_sync_is_silent():
    assert ids(step("""\
        model.require_backward_grad_sync = False
        model(x).sum().backward()
        """)) == []


def test_a_backward_outside_no_sync_still_double_reduces():
    assert ids(step("""\
        with model.no_sync():
            model(x).sum().backward()
        model(x).sum().backward()   # DDP reduces here
        """)) == [("DD005", "error")]
    # a switch that turns the reduction on for the last micro-step (nanoGPT's) is not "off"
    assert ids(step("""\
        model.require_backward_grad_sync = last
        model(x).sum().backward()
        """)) == [("DD005", "error")]
