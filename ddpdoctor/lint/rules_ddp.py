"""DD005: all_reduce of a DDP model's gradients/parameters; DD010: a barrier in a DDP training loop."""

from __future__ import annotations

import ast
from typing import Iterator

from ..analysis.findings import Finding
from ..source.names import dotted
from ..source.units import Func
from .finding import loc, make
from .rulekit import (
    RuleFamily,
    argument,
    canon_of,
    loops_of,
    strip_module,
)


class DdpRules(RuleFamily):
    """Manual synchronisation on top of what DistributedDataParallel already does."""

    def rules(self) -> list:
        return [("DD005", self.manual_allreduce, ("parameters",)),
                ("DD010", self.barrier_in_step, ("barrier",))]

    # -- DD005 -------------------------------------------------------------------------------------
    def manual_allreduce(self, func: Func) -> Iterator[Finding]:
        for node in func.scope:
            if not isinstance(node, (ast.For, ast.AsyncFor)) or not isinstance(node.iter, ast.Call):
                continue
            it = node.iter.func
            if not isinstance(it, ast.Attribute) or it.attr not in ("parameters", "named_parameters"):
                continue
            owner = strip_module(it.value)
            k = self.cm.kind(owner, func, node.lineno)
            if k is None or k[0] not in ("ddp", "fsdp"):
                continue
            target = node.target
            if it.attr == "named_parameters" and isinstance(target, ast.Tuple) and len(target.elts) == 2:
                target = target.elts[1]
            p = dotted(target)
            if p is None:
                continue
            for call in (n for s in node.body for n in ast.walk(s) if isinstance(n, ast.Call)):
                canon = canon_of(func, call.func)
                if not canon.startswith("torch.distributed.") or canon.rsplit(".", 1)[-1] not in (
                        "all_reduce", "reduce", "all_reduce_coalesced"):
                    continue
                arg = dotted(argument(call, 0, "tensor") or ast.Constant(None)) or ""
                if arg in (f"{p}.grad", f"{p}.grad.data"):
                    sev, what = "error", "gradients"
                elif arg in (p, f"{p}.data"):
                    sev, what = "warning", "parameters"
                else:
                    continue
                model = dotted(owner) or "the model"
                msg = (f"{dotted(call.func)}() at line {call.lineno} reduces the {what} of `{model}`, which is "
                       f"wrapped in {'DistributedDataParallel' if k[0] == 'ddp' else 'FSDP'} (the loop at line "
                       f"{node.lineno}); DDP already averages gradients in backward, so this sums the averages "
                       f"(x world size) and costs a second all-reduce per parameter.")
                yield make("DD005", sev, msg, [loc(func.module, call.lineno, "call", func.name),
                                               loc(func.module, node.lineno, "loop", func.name)],
                           fix="Remove the manual all_reduce (DDP reduces gradients in backward); to change how "
                               "gradients are reduced, register a DDP communication hook.",
                           title_text=None if what == "gradients" else "Parameters of a DDP model reduced by hand")

    # -- DD010 -------------------------------------------------------------------------------------
    def barrier_in_step(self, func: Func) -> Iterator[Finding]:
        for node, _outer in loops_of(func):
            # the barrier and the DDP step at the same loop level (a per-epoch barrier is fine)
            flat = [s for s in node.body if not isinstance(s, (ast.For, ast.AsyncFor, ast.While, ast.If))]
            direct = [c for s in flat for _k, c in self.cm.stmt(s, func)]
            barriers = [c for c in direct if c.op == "barrier" and not c.via]
            if barriers and any(c.op in ("ddp-backward", "ddp-forward") for c in direct):
                b = barriers[0]
                yield make("DD010", "info",
                           f"dist.barrier() at line {b.line} runs every iteration of the training loop at line "
                           f"{node.lineno}, whose DDP backward already synchronises the ranks: it adds a round trip "
                           f"per step and buys nothing.",
                           [loc(func.module, b.line, "call", func.name), loc(func.module, node.lineno, "loop", func.name)],
                           fix="Remove the per-step barrier; keep barriers where files or a single rank's work must be "
                               "ordered (e.g. after rank 0 saves a checkpoint).")
