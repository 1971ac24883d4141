"""DD005: all_reduce of a DDP model's gradients/parameters; DD010: a barrier in a DDP training loop;
DD013: a DDP model's parameters changed on some ranks only after wrapping."""

from __future__ import annotations

import ast
from typing import Iterator

from ..analysis.findings import Finding
from ..source.names import dotted
from ..source.taint import describe, is_heuristic
from ..source.units import Func
from .comm import DDP_CTORS
from .finding import loc, make
from .rulekit import (
    RuleFamily,
    argument,
    calls_of,
    canon_of,
    loops_of,
    strip_module,
)


def _ddp_reduction_skipped(func: Func) -> bool:
    """Whether every backward of ``func`` runs inside a ``with <model>.no_sync():`` block, or DDP's
    reduction is switched off by ``<model>.require_backward_grad_sync = False``: then DDP reduces
    no gradient and a manual all-reduce after it is the job's only one (custom gradient sync)."""
    backwards, inside = [], set()
    for node in func.scope:
        if isinstance(node, (ast.With, ast.AsyncWith)) and any(
                isinstance(it.context_expr, ast.Call) and isinstance(it.context_expr.func, ast.Attribute)
                and it.context_expr.func.attr == "no_sync" for it in node.items):
            inside.update(id(n) for s in node.body for n in ast.walk(s))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "backward":
            backwards.append(node)
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Attribute) and t.attr == "require_backward_grad_sync"
                                                  for t in node.targets):
            if isinstance(node.value, ast.Constant) and node.value.value is False:
                return True
    return bool(backwards) and all(id(b) in inside for b in backwards)


class DdpRules(RuleFamily):
    """Manual synchronisation on top of what DistributedDataParallel already does."""

    def rules(self) -> list:
        return [("DD005", self.manual_allreduce, ("parameters",)),
                ("DD010", self.barrier_in_step, ("barrier",)),
                ("DD013", self.replica_edit, ("DistributedDataParallel", "DDP"))]

    # -- DD005 -------------------------------------------------------------------------------------
    def manual_allreduce(self, func: Func) -> Iterator[Finding]:
        if _ddp_reduction_skipped(func):
            return  # DDP reduced nothing: the manual reduction is the only one
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

    # -- DD013 -------------------------------------------------------------------------------------
    #: Calls that change a module's parameters in place (tensor methods, nn.init, whole modules).
    _EDITS = frozenset({"normal_", "uniform_", "fill_", "zero_", "copy_", "mul_", "add_", "sub_", "div_",
                        "clamp_", "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_",
                        "orthogonal_", "trunc_normal_", "constant_", "ones_", "zeros_", "reset_parameters",
                        "load_state_dict"})

    def replica_edit(self, func: Func) -> Iterator[Finding]:
        # names of DDP wrappers and of the modules they wrap -> line of the wrap
        wrapped: dict[str, int] = {}
        for node in func.scope:
            if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)):
                continue
            call = node.value
            canon = canon_of(func, call.func)
            if canon not in DDP_CTORS and canon.rsplit(".", 1)[-1] != "DistributedDataParallel":
                continue
            names = [dotted(t) for t in node.targets] + [dotted(argument(call, 0, "module") or ast.Constant(None))]
            for n in names:
                if n:
                    wrapped.setdefault(n, node.lineno)
        if not wrapped:
            return
        calls = calls_of(func)
        # a later broadcast may be the repair (rank 0 loads, then broadcasts); a model never run
        # after the edit (rank 0 evaluates the best weights at the end) trains nothing different
        broadcasts = [c.lineno for c in calls if canon_of(func, c.func).rsplit(".", 1)[-1].startswith("broadcast")]
        runs = [c.lineno for c in calls if (isinstance(c.func, ast.Name) and c.func.id in wrapped)
                or (isinstance(c.func, ast.Attribute) and c.func.attr in ("backward", "step"))]
        for node in func.scope:
            if not isinstance(node, ast.If):
                continue
            t = self.prog.taint(func, node.test)
            if not t:
                continue
            for branch in (node.body, node.orelse):
                for call in (n for s in branch for n in ast.walk(s) if isinstance(n, ast.Call)):
                    f = call.func
                    last = f.attr if isinstance(f, ast.Attribute) else (f.id if isinstance(f, ast.Name) else "")
                    if last not in self._EDITS:
                        continue
                    # the tensor or module changed: the method's receiver, or nn.init's first argument
                    target = argument(call, 0, "tensor") if canon_of(func, f).startswith("torch.nn.init.") else (
                        f.value if isinstance(f, ast.Attribute) else None)
                    root = target
                    while isinstance(root, (ast.Attribute, ast.Subscript, ast.Call)):
                        root = root.func if isinstance(root, ast.Call) else root.value
                    name = root.id if isinstance(root, ast.Name) else None
                    since = wrapped.get(name) if name else None
                    if since is None or call.lineno <= since:
                        continue
                    if any(b > call.lineno for b in broadcasts) or not any(r > node.end_lineno for r in runs):
                        continue
                    what = unparsed_or(target)
                    yield make("DD013", "warning" if is_heuristic(t) else "error",
                               f"`{what}` is changed by {last}() at line {call.lineno}, after `{name}` was wrapped in "
                               f"DistributedDataParallel (line {since}), only on ranks where the condition at line "
                               f"{node.lineno} holds; it depends on the rank through {describe(t)}. DDP copies "
                               f"rank 0's parameters once, at construction: from here on the ranks hold different "
                               f"models, every collective still matches and each rank trains its own.",
                               [loc(func.module, call.lineno, "write", func.name),
                                loc(func.module, node.lineno, "condition", func.name),
                                loc(func.module, since, "call", func.name)],
                               fix="Change the parameters on every rank, or before wrapping in DDP (its construction "
                                   "broadcasts rank 0's values); to load a checkpoint, load it on every rank.")


def unparsed_or(node) -> str:
    """The source of ``node``, or a generic name."""
    try:
        return ast.unparse(node) if node is not None else "the model"
    except Exception:  # noqa: BLE001 - a description only
        return "the model"
