"""divergent-parameter-use: a DDP model whose ranks gave gradients to different parameters in the
same backward (``find_unused_parameters=True``), so DDP averaged zeros from the ranks that skipped
them.

Each rank records (``grad_used``, ``rank/patches/paramuse.py``) a backward where DDP's all-reduced
used map counts some parameter as used on some ranks only, with the counts, its own use when it
could read it before the reduction, and where the owning modules' ``forward`` is defined. The
first such backward is reported with the modules, the ranks that used them, and the condition in
the ``forward`` that decided: a rank-dependent condition (the linter's analysis) or a random draw
is an error (the ranks train different sub-networks); otherwise (routing on the data, e.g. a
mixture of experts or per-task heads, which DDP supports by design) it is info.
"""

from __future__ import annotations

import ast
from collections import defaultdict

from ...trace.sourceinfo import source_lines
from ...verdict import rankdep
from ..findings import Location
from . import _fsdp_parted
from .base import Check, Context, Divergence, Kind, fmt

#: Call or attribute names that draw random numbers (spelling only: a random source in a condition).
_RANDOM = frozenset({"rand", "random", "randn", "randint", "rand_like", "randn_like", "bernoulli",
                     "uniform", "choice", "choices", "multinomial", "normal", "sample", "random_sample",
                     "randperm", "permutation", "binomial", "integers", "shuffle"})


def _int(v, default: int = 0) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return default


def _function(tree: ast.AST, first: int):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = [node.lineno] + [d.lineno for d in node.decorator_list]
            if first in lines:
                return node
    return None


def _uses(func: ast.AST, child: str) -> set[str]:
    """Names bound to ``self.<child>`` (or an element of it) in ``func``, besides ``self.<child>``."""
    names: set[str] = set()
    for node in ast.walk(func):
        target, value = None, None
        if isinstance(node, (ast.For, ast.comprehension)):
            target, value = node.target, node.iter
        elif isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        if target is None or not isinstance(target, ast.Name):
            continue
        text = ast.unparse(value) if value is not None else ""
        if f"self.{child}" in text:
            names.add(target.id)
    return names


def _mentions(node: ast.AST, child: str, names: set[str]) -> bool:
    text = ast.unparse(node)
    return f"self.{child}" in text or any(isinstance(n, ast.Name) and n.id in names for n in ast.walk(node))


def deciders(file: str, first: int, child: str) -> list[tuple[int, str, str]]:
    """The conditions of the ``forward`` at ``file:first`` that decide whether ``self.<child>``
    runs: ``(line, text, why)`` with ``why`` ``rank`` (rank-dependent, per the linter's analysis) or
    ``random`` (a random draw); conditions around or before a use of the child, in the same loop."""
    lines = source_lines(file)
    if not lines:
        return []
    try:
        tree = ast.parse("".join(lines))
    except (SyntaxError, ValueError):
        return []
    func = _function(tree, first)
    if func is None:
        return []
    names = _uses(func, child) if child else set()
    # conditions that skip the rest of a loop over the child (layer drop: `if draw: continue`)
    in_loop: set[int] = set()
    for loop in ast.walk(func):
        if isinstance(loop, (ast.For, ast.AsyncFor)) and child and f"self.{child}" in ast.unparse(loop.iter):
            for n in ast.walk(loop):
                if isinstance(n, ast.If) and any(isinstance(k, (ast.Continue, ast.Break))
                                                 for b in n.body for k in ast.walk(b)):
                    in_loop.add(id(n))
    out: list[tuple[int, str, str]] = []
    for node in ast.walk(func):
        if not isinstance(node, (ast.If, ast.IfExp, ast.While)):
            continue
        test = node.test
        body = node.body if isinstance(node.body, list) else [node.body]
        orelse = node.orelse if isinstance(node.orelse, list) else [node.orelse]
        near = any(_mentions(s, child, names) for s in body + orelse) if child else True
        if not (near or id(node) in in_loop):
            continue
        text = ast.get_source_segment("".join(lines), test) or ast.unparse(test)
        called = {n.attr if isinstance(n, ast.Attribute) else n.id
                  for n in ast.walk(test) if isinstance(n, (ast.Attribute, ast.Name))}
        header = lines[node.lineno - 1].strip() if node.lineno - 1 < len(lines) else text
        why = ""
        if rankdep.judge(file, node.lineno, header).state == "yes":
            why = "rank"
        elif called & _RANDOM:
            why = "random"
        if why:
            out.append((node.lineno, text, why))
    out.sort(key=lambda t: (t[2] != "rank", t[0]))
    return out


class DivergentParameterUse(Check):
    id = "DD016"
    category = "divergent-parameter-use"
    severity = "error"
    title = "DDP ranks gave gradients to different parameters: DDP averaged zeros from the others"
    fix = ("Make the decision that skips a module the same on every rank: draw layer drop / stochastic "
           "depth from a generator seeded alike on every rank (or broadcast the draw), never branch on "
           "the rank inside `forward`; keep per-rank randomness for data augmentation and dropout.")
    kinds = {"data": Kind(
        severity="info",
        title="DDP ranks gave gradients to different parameters (data-dependent use)",
        fix=("Nothing to change if the routing depends on each rank's data (mixture of experts, "
             "per-task heads): DDP averages zeros for the ranks that did not use a parameter, which "
             "scales its update by the fraction of ranks that did.")),
        "fsdp": Kind(
            title="An FSDP module ran its forward (or backward) on some ranks only",
            fix=("Run every `fully_shard` module on every rank in the same order: make the condition "
                 "around it the same on every rank (or run the module and discard its output); FSDP "
                 "all-gathers its parameters in each call, so a module skipped on one rank pairs "
                 "different modules' collectives across ranks."))}

    def explains(self, ctx: Context, divergence: Divergence) -> bool:
        return any(p.group == divergence.group and p.seq <= divergence.point.seq
                   for p in ctx.shared("fsdp_partings", _fsdp_parted.partings))

    def run(self, ctx: Context):
        per_module: dict[int, dict[int, list[dict]]] = defaultdict(dict)
        for rank, rt in ctx.run.ranks.items():
            for r in rt.records("grad_used"):
                per_module[_int(r.get("id"))].setdefault(rank, []).append(r)
        out = []
        for idx, per_rank in sorted(per_module.items()):
            f = self._module(ctx, idx, per_rank)
            if f is not None:
                out.append(f)
        for part in ctx.shared("fsdp_partings", _fsdp_parted.partings):
            out.append(self._fsdp(ctx, part))
        return out

    def _fsdp(self, ctx: Context, part: _fsdp_parted.Parting):
        phase = "backward (gradient reduce-scatter)" if part.backward else "forward (parameter all-gather)"
        per = []
        for r, sid in sorted(part.sites.items()):
            calls = ", ".join(f"`{c}(...)`" for c in part.calls.get(r, [])[:3]) or "a module"
            per.append(f"rank {r} for {calls} at {ctx.where(r, sid)}")
        under = {r: locs for r, locs in part.conditions.items() if locs}
        msg = (f"{part.op} #{part.seq} in process group {part.group} is an FSDP {phase} that the ranks "
               f"issued for different modules: {'; '.join(per)}.")
        locs = []
        ranks = sorted(part.sites)
        if under:
            r, conds = min(under.items())
            c = conds[0]
            how = "rank-dependent" if c.role == "condition" else "taken on some ranks only"
            first = (part.calls.get(r) or ["the module"])[0]
            msg += (f" `{first}` ran on {fmt(under)} only, under `{c.source}` at "
                    f"{c.file.rsplit('/', 1)[-1]}:{c.line} ({how}).")
            locs.append(c)
            ranks = sorted(under)
        msg += (" From there on FSDP pairs different modules' collectives across ranks: they abort on "
                "different sizes, hang, or silently mix parameters.")
        locs += [ctx.loc(r, sid, "call") for r, sid in sorted(part.sites.items())][:6]
        return self.finding(msg, ranks, locs, kind="fsdp",
                            data={"group": part.group, "seq": part.seq, "op": part.op,
                                  "calls": {str(r): c for r, c in part.calls.items()}, "ranks": ranks})

    def _module(self, ctx: Context, idx: int, per_rank: dict[int, list[dict]]):
        steps: dict[int, dict[int, dict]] = defaultdict(dict)
        total = {}
        for rank, recs in per_rank.items():
            for r in recs:
                if r.get("at") == "exit":
                    total[rank] = (_int(r.get("steps")), _int(r.get("of")))
                elif isinstance(r.get("names"), list):
                    steps[_int(r.get("step"))][rank] = r
        if not steps:
            return None
        first = min(steps)
        recs = steps[first]
        r0 = min(recs)
        ref = recs[r0]
        world = _int(ref.get("world"), len(ctx.run.ranks))
        names = [str(n) for n in ref.get("names") or []]
        cnt = [_int(c) for c in ref.get("cnt") or []]
        users = self._users(recs, names, cnt, world)
        mods: dict[str, list[str]] = {}
        for n in names:
            mod, _, leaf = n.rpartition(".")
            mods.setdefault(mod or "(root)", []).append(leaf)
        parts = []
        for mod, leaves in list(mods.items())[:6]:
            n0 = f"{mod}.{leaves[0]}" if mod != "(root)" else leaves[0]
            c = cnt[names.index(n0)] if n0 in names and names.index(n0) < len(cnt) else "?"
            who = users.get(mod)
            on = f"{fmt(who)} only" if who else f"{c} of {world} ranks"
            parts.append(f"`{mod}` ({', '.join(leaves[:4])}) on {on}")
        more = f" and {len(mods) - 6} more modules" if len(mods) > 6 else ""
        fwd = next((r.get("fwd") for rs in per_rank.values() for r in rs if r.get("fwd")), None) or []
        found = self._conditions(fwd, list(mods))
        rank_steps = [t for t in total.values() if t[1]]
        often = (f" It happened in {max(t[0] for t in rank_steps)} of {max(t[1] for t in rank_steps)} "
                 "backward passes." if rank_steps else "")
        msg = (f"At backward #{first} of the DDP model run at {ctx.where(r0, ref.get('site'))} "
               f"(find_unused_parameters=True), parameters received gradients on some ranks only: "
               f"{'; '.join(parts)}{more}. DDP averaged zeros from the other ranks for them (their "
               f"updates are scaled by the fraction of ranks that used them).{often}")
        locs = [ctx.loc(r0, ref.get("site"), "forward")]
        data = {"module": idx, "step": first, "modules": list(mods), "users": users, "world": world}
        if found:
            line, text, why, file = found[0]
            what = "a rank-dependent condition" if why == "rank" else (
                "a random draw, which differs across ranks here (their generators are seeded or "
                "advanced differently)")
            msg += (f" What decided: {what}, `{text}` at {file.rsplit('/', 1)[-1]}:{line}. The ranks "
                    "train different sub-networks.")
            locs.insert(0, Location(r0, file, line, "", text, "condition"))
            data["decided_by"] = why
            return self.finding(msg, sorted(recs), locs, data=data)
        msg += (" No rank-dependent condition or random draw was found around those modules in the "
                "forward: if the routing depends on each rank's data, this is how DDP is meant to work.")
        return self.finding(msg, sorted(recs), locs, data=data, kind="data")

    @staticmethod
    def _users(recs: dict[int, dict], names: list[str], cnt: list[int], world: int) -> dict[str, list[int]]:
        """Module -> the ranks that used its partial parameters, where the ranks' own reads
        (``mine``) settle it: the ranks that say they used it, when they are as many as the count
        says; or all but those that say they did not, when those are as many as the unused."""
        out: dict[str, list[int]] = {}
        for i, name in enumerate(names):
            if i >= len(cnt):
                break
            yes = [r for r, rec in recs.items() if _mine(rec, i) == 1]
            no = [r for r, rec in recs.items() if _mine(rec, i) == 0]
            users = None
            if len(yes) == cnt[i]:
                users = sorted(yes)
            elif len(no) == world - cnt[i] and len(recs) == world:
                users = sorted(r for r in recs if r not in no)
            mod = name.rpartition(".")[0] or "(root)"
            if users is not None and mod not in out:
                out[mod] = users
        return out

    @staticmethod
    def _conditions(fwd: list, mods: list[str]) -> list[tuple[int, str, str, str]]:
        """Deciding conditions in the recorded forwards, nearest module first."""
        found = []
        for entry in fwd:
            if not isinstance(entry, list) or len(entry) != 4:
                continue
            file, line, child = str(entry[1]), _int(entry[2]), str(entry[3])
            for ln, text, why in deciders(file, line, child):
                found.append((ln, text, why, file))
            if found:
                break
        return found


def _mine(rec: dict, i: int):
    mine = rec.get("mine")
    if isinstance(mine, list) and i < len(mine):
        return _int(mine[i], -1)
    return None
