"""FSDP2 modules whose forward ran on some ranks only, from the recorded collectives.

``fully_shard`` modules all-gather their parameters in a forward pre-hook (and reduce-scatter
their gradients in backward) through ``torch.distributed``, so each such collective is recorded
with the user's line that called the module (its ``site``, with FSDP's frames in ``lib``). When
rank-dependent control flow runs a module on some ranks only, the ranks' FSDP collectives at the
same position come from different lines: this finds that position (the first metadata mismatch or
divergence of a group) and names, per rank, the module calls on its line and the branch the
rank's call is under that the others' are not. Nothing is recorded for it beyond the collectives.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

from .base import Context

_OPS = frozenset({"all_gather_into_tensor", "all_gather_single", "all_gather", "reduce_scatter_tensor",
                  "reduce_scatter_single", "reduce_scatter", "all_reduce"})
#: Callee owners that are libraries, not submodules (``torch.relu(...)``, ``F.linear(...)``).
_LIBS = frozenset({"torch", "F", "nn", "np", "numpy", "math", "dist", "functional", "random"})


@dataclass
class Parting:
    """One position where the ranks' FSDP collectives came from different lines."""

    group: str
    seq: int
    op: str
    sites: dict[int, object]  # rank -> site id
    calls: dict[int, list[str]]  # rank -> submodule calls on its line, in evaluation order
    conditions: dict[int, list] = field(default_factory=dict)  # rank -> [Location] (split_conditions)
    backward: bool = False


def _is_fsdp(site: dict) -> bool:
    text = str(site.get("via", "")) + " ".join(str(f[0]) for f in site.get("lib") or [] if isinstance(f, list) and f)
    return "fsdp" in text.lower()


def _backward(site: dict) -> bool:
    return any(isinstance(f, list) and len(f) > 2 and "backward" in str(f[2]) for f in site.get("lib") or [])


def module_calls(src: str) -> list[str]:
    """``x.attr(...)`` calls of a source line, in evaluation order (arguments first), without the
    library ones: the submodules the line runs."""
    try:
        tree = ast.parse(src.strip().rstrip(":") or "pass")
    except SyntaxError:
        return []
    out: list[str] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            visit(child)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            base = owner
            while isinstance(base, (ast.Attribute, ast.Subscript)):
                base = base.value
            if isinstance(base, ast.Name) and base.id not in _LIBS and not (owner is base and base.id[:1].isupper()):
                name = ast.unparse(node.func)
                if name not in out:
                    out.append(name)

    visit(tree)
    return out


def partings(ctx: Context) -> list[Parting]:
    """The first FSDP parting of each group (a metadata mismatch or the divergence)."""
    out = []
    for g in ctx.groups:
        points = list(ctx.mismatches.get(g, []))
        if g in ctx.divergences:
            points.append(ctx.divergences[g])
        for p in sorted(points, key=lambda p: p.seq):
            evs = {r: ev for r, ev in p.events.items() if ev is not None}
            if len(evs) < 2 or any(ev.get("op") not in _OPS for ev in evs.values()):
                continue
            sites = {r: ev.get("site") for r, ev in evs.items()}
            info = {r: ctx.site(r, sid) for r, sid in sites.items()}
            if not all(_is_fsdp(s) for s in info.values()):
                continue
            lines = {(s.get("file"), s.get("line")) for s in info.values()}
            if len(lines) < 2:
                continue
            part = Parting(g, p.seq, str(next(iter(evs.values())).get("op")), sites,
                           {r: module_calls(str(s.get("src", ""))) for r, s in info.items()},
                           backward=any(_backward(s) for s in info.values()))
            for r, sid in sites.items():
                others = [(o, osid) for o, osid in sites.items() if o != r]
                try:
                    part.conditions[r] = ctx.split_conditions(r, sid, others)
                except Exception:  # the source analysis must never break a report
                    part.conditions[r] = []
            out.append(part)
            break
    return out
