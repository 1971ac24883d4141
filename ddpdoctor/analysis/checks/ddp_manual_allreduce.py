"""ddp-manual-allreduce: a reducing collective on the gradients (or parameters) of a module that
DistributedDataParallel already synchronises.

The recorder marks collectives whose tensors overlap the memory of a DDP module's parameters or
their ``.grad`` (event field ``ddp_overlap``, e.g. ``["fc.weight.grad"]``). DDP's backward has
already averaged the gradients, so a second all_reduce sums averaged values: with SUM they come out
multiplied by the world size. All-reducing a loss or a metric shares no memory with them and is
never flagged.
"""

from __future__ import annotations

from collections import defaultdict

from ...trace import ops
from .base import Check, Context, fmt

#: Ops that combine values across ranks (broadcast only copies identical values: harmless here).
_REDUCING = ops.REDUCING
#: Reduce ops under which a second reduction changes the values (not just wastes bandwidth).
_CHANGING = frozenset({"SUM", "PRODUCT", "?", ""})


class DdpManualAllreduce(Check):
    id = "DD005"
    category = "ddp-manual-allreduce"
    severity = "error"
    title = "Gradients of a DDP model reduced again by hand"
    fix = ("Remove the manual all_reduce: DistributedDataParallel already averages the gradients in "
           "backward. To synchronise by hand instead, do not wrap the model in DDP (or use "
           "model.no_sync() / call model.module), and divide by the world size.")

    def run(self, ctx: Context):
        groups: dict[tuple, dict] = {}
        for rank, rt in ctx.run.ranks.items():
            ddp_bwd = rt.ddp_steps.get("ddp_backward", 0)
            for ev in rt.overlaps:
                op = ev.get("op")
                if op not in _REDUCING:
                    continue
                names = [str(n) for n in ev.get("ddp_overlap") or ()]
                grads = [n for n in names if n.endswith(".grad")]
                params = [n for n in names if not n.endswith(".grad")]
                for kind, hit in (("grad", grads), ("param", params)):
                    if not hit:
                        continue
                    if kind == "grad" and not ddp_bwd:
                        continue  # DDP never reduced these gradients: the manual reduction is the only one
                    s = ctx.site(rank, ev.get("site"))
                    key = (s.get("file"), s.get("line"), op, kind)
                    g = groups.setdefault(key, {"ranks": set(), "names": [], "rops": defaultdict(int),
                                                "calls": 0, "first": (rank, ev)})
                    g["ranks"].add(rank)
                    g["calls"] += 1
                    g["rops"][str(ev.get("rop", "?"))] += 1
                    for n in hit:
                        if n not in g["names"] and len(g["names"]) < 12:
                            g["names"].append(n)
        return [self._finding(ctx, key, g) for key, g in groups.items()]

    def _finding(self, ctx: Context, key: tuple, g: dict):
        _file, _line, op, kind = key
        rank, ev = g["first"]
        rops = sorted(g["rops"])
        rop = "/".join(rops)
        changing = any(r in _CHANGING for r in rops)
        world = len(ctx.run.group_members(str(ev.get("g", "0")))) or ctx.run.world  # the DDP group's size
        names = ", ".join(g["names"]) + ("..." if len(g["names"]) >= 12 else "")
        where = ctx.where(rank, ev.get("site"))
        calls = f"{g['calls']} call(s) on {fmt(g['ranks'])}"
        if kind == "grad":
            msg = (f"{op} ({rop}) at {where} reduces gradients of a DistributedDataParallel model "
                   f"({names}; {calls}) that DDP's backward has already averaged across ranks: the gradients "
                   f"are reduced twice.")
            if changing:
                msg += (f" With {rop} they come out multiplied by the world size ({world}), as if the learning "
                        f"rate were {world}x larger; dividing afterwards restores the values but still doubles "
                        f"the gradient communication.")
                sev = "error"
            else:
                msg += f" With {rop} the values stay the same, but the gradient communication is doubled."
                sev = "warning"
            title = self.title
        else:
            msg = (f"{op} ({rop}) at {where} reduces parameters of a DistributedDataParallel model "
                   f"({names}; {calls}). DDP keeps the replicas identical already"
                   + (f"; with {rop} every parameter comes out multiplied by the world size ({world})."
                      if changing else "; this only costs communication."))
            sev = "warning"
            title = "Parameters of a DDP model reduced by hand"
        return self.finding(msg, sorted(g["ranks"]), [ctx.loc(rank, ev.get("site"), "call")],
                            severity=sev, title=title,
                            evidence=[[fmt(g["ranks"]), f"{op} {rop} on {names}", where]],
                            data={"op": op, "rop": rops, "target": kind, "names": g["names"],
                                  "calls": g["calls"]})
