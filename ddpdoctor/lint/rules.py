"""The static rules other than the structural one (``structure``), mapped to the trace checks'
ids, one module per family: ``rules_collectives`` (DD002 rank-sized tensors, DD011 p2p counts,
DD012 collectives outside the group's lifetime), ``rules_files`` (DD003 files shared without a
collective), ``rules_data`` (DD004 rank-seeded randomness, DD007 DistributedSampler misuse),
``rules_ddp`` (DD005 manual gradient all-reduce, DD010 per-step barriers). What they share is in
``rulekit``.
"""

from __future__ import annotations

from ..analysis.findings import Finding
from ..source.program import Program
from .comm import CommModel
from .rules_collectives import CollectiveRules
from .rules_data import DataRules
from .rules_ddp import DdpRules
from .rules_files import FileRules

#: The order in which the rules run (their findings are sorted afterwards; a rule whose id is
#: not here is a programming error).
ORDER = ("DD002", "DD003", "DD004", "DD005", "DD007", "DD010", "DD012", "DD013", "DD014", "DD011")


class Rules:
    """Every rule family over one program."""

    def __init__(self, prog: Program, cm: CommModel) -> None:
        self.prog = prog
        self.cm = cm
        self.families = [CollectiveRules(prog, cm), FileRules(prog, cm), DataRules(prog, cm), DdpRules(prog, cm)]

    def run(self, enabled: set[str]) -> list[Finding]:
        out: list[Finding] = []
        # (id, rule, words one of which the module's source must contain for the rule to apply:
        # a cheap filter that keeps the linter fast on code that has nothing to do with it)
        table = sorted((row for fam in self.families for row in fam.rules()), key=lambda row: ORDER.index(row[0]))
        per_module: dict[str, list] = {}
        for f in self.prog.funcs:
            rules = per_module.get(f.module.path)
            if rules is None:
                src = f.module.source
                rules = per_module[f.module.path] = [rule for cid, rule, words in table
                                                     if cid in enabled and any(w in src for w in words)]
            if id(f) in self.prog.skipped:
                continue
            for rule in rules:
                try:
                    out.extend(rule(f))
                except RecursionError:
                    self.prog.skip(f)
        return out
