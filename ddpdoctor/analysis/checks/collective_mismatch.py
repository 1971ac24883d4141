"""collective-mismatch: the same collective at the same position with different metadata."""

from __future__ import annotations

from collections import defaultdict

from ...verdict import blame
from .base import Check, Context, Divergence, fmt

_FIELDS = (("x", "tensors"), ("rop", "reduce op"), ("root", "root rank"), ("groot", "root rank"),
           ("nobj", "object count"))


class CollectiveMismatch(Check):
    id = "DD002"
    category = "collective-mismatch"
    severity = "error"
    title = "Same collective, different shapes/dtypes/reduce ops/roots across ranks"
    fix = ("Pass tensors of the same shape and dtype, the same reduce op and the same root on every "
           "rank; pad variable-sized data (or all_gather the sizes first) before the collective.")

    def explains(self, ctx: Context, divergence: Divergence) -> bool:
        # Ranks that passed different sizes to a collective leave it at different times and
        # drift apart: the mismatch before the divergence is the root cause.
        return any(m.seq < divergence.point.seq for m in ctx.mismatches.get(divergence.group, []))

    def run(self, ctx: Context):
        findings = []
        for group in ctx.groups:
            for p in ctx.mismatches.get(group, []):
                ev0 = next(iter(p.events.values()))
                op = ev0.get("op")
                diffs = []
                evidence = []
                for key, label in _FIELDS:
                    vals = defaultdict(list)
                    for r, ev in p.events.items():
                        vals[str(ev.get(key, "-"))].append(r)
                    if len(vals) > 1:
                        diffs.append(label + ": " + "; ".join(f"{fmt(rs)} {v}" for v, rs in vals.items()))
                        evidence.extend([fmt(rs), f"{label} {v}", ctx.where(rs[0], p.events[rs[0]].get("site"))]
                                        for v, rs in vals.items())
                sizes = defaultdict(list)
                for r, ev in p.events.items():
                    sizes[str(ev.get("x", ""))].append(r)
                found = blame.minority(sizes)
                minority = found[1] if found is not None else []
                locs = [ctx.loc(r, ev.get("site")) for r, ev in sorted(p.events.items())][:8]
                where = ctx.where(min(p.events), p.events[min(p.events)].get("site"))
                msg = (f"{op} #{p.seq} in process group {group} ({where}) differs across ranks: "
                       + " | ".join(diffs) + ". Mismatched collectives abort (\"Received data size doesn't "
                       "match\"), hang, or silently mix unrelated data." + _outcome(ctx, p))
                findings.append(self.finding(msg, minority or list(p.events), locs, evidence=evidence,
                                             data={"group": group, "seq": p.seq, "op": op}))
        return findings


def _outcome(ctx: Context, p) -> str:
    """How the ranks came out of the mismatched call: the backend may complete it on some ranks
    (partially filled buffers) and abort only later, so the crash is reported elsewhere (DD008)
    while this call is its root cause."""
    died_in = sorted(r for r, ev in p.events.items() if ev.get("pending"))
    completed = sorted(r for r, ev in p.events.items() if not ev.get("pending") and not ev.get("err"))
    later = []
    for r, rt in sorted(ctx.run.ranks.items()):
        if r in died_in or r not in p.events:
            continue
        ex = rt.exit_record() or {}
        if ex.get("how") in ("exception", "crash") or rt.exit_record() is None:
            later.append(r)
    parts = []
    if completed and (died_in or later):
        parts.append(f" {fmt(completed)} completed it (the backend accepted it: their buffers hold "
                     "partial or mixed data)")
    if died_in:
        parts.append(f"{';' if parts else ''} {fmt(died_in)} died inside it")
    if later:
        parts.append(f"{';' if parts else ''} {fmt(later)} failed later")
    if not parts:
        return ""
    return "".join(parts) + ": this mismatch is the root cause of the failures reported after it."
