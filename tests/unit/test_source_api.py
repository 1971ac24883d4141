"""The source analysis as the rest of ddpdoctor uses it (issue #15): the rank-dependence API of
ddpdoctor.source, without the linter, on one file or on several at once."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from support.jobs import ROOT

import ddpdoctor.lint
from ddpdoctor.source.program import Program
from ddpdoctor.source.rankdep import condition_is_rank_dependent, condition_verdict

HELPERS = textwrap.dedent("""\
    import torch.distributed as dist

    def is_main():
        return dist.get_rank() == 0
""")
TRAIN = textwrap.dedent("""\
    from helpers import is_main

    def step(world):
        if is_main():
            print("saving")
        if world > 1:
            pass
""")


def test_one_implementation_for_the_linter_and_the_trace_analysis():
    assert ddpdoctor.lint.condition_is_rank_dependent is condition_is_rank_dependent


def test_conditions_across_files_from_one_program():
    prog = Program.from_sources({"helpers.py": HELPERS, "train.py": TRAIN})
    v = condition_verdict(prog, "train.py", 4)
    assert v and v.sure and "get_rank" in v.reason
    assert condition_verdict(prog, "train.py", 6).state == "no"
    assert condition_verdict(prog, "train.py", 5).state == "unknown"  # no condition starts there
    assert condition_verdict(prog, "other.py", 1).state == "unknown"
    # one file alone: the helper's body is out of view, so only its name says so (not sure)
    alone = condition_is_rank_dependent(TRAIN, 4, "train.py")
    assert alone and not alone.sure
    assert condition_is_rank_dependent("if (:\n", 1).state == "unknown"


def test_the_source_analysis_imports_nothing_else_of_ddpdoctor():
    code = ("import sys; from ddpdoctor.source import condition_is_rank_dependent as c; "
            "c('import torch.distributed as dist\\nif dist.get_rank() == 0:\\n    pass\\n', 2); "
            "print(sorted(m for m in sys.modules if m.startswith(('ddpdoctor', 'torch'))))")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    mods = json.loads(p.stdout.strip().replace("'", '"'))
    assert [m for m in mods if not m.startswith("ddpdoctor.source")] == ["ddpdoctor"]
