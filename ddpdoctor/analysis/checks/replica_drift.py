"""replica-drift: DDP replicas whose parameters (or buffers) differ across ranks.

DDP's invariant is identical parameters on every rank after every step: the gradients are
averaged, so the same optimizer applies the same update to the same values. Each rank records a
digest of its replica (``replica`` records: a CRC-32 per parameter and buffer over a strided
sample of its bits, and its in-place version counter) after construction, after the first
optimizer steps, every N steps, before checkpoint saves and at exit. Digests taken at the same
optimizer step are compared; the first step where they differ is reported with the parameters
that differ and what last wrote them on the odd ranks.
"""

from __future__ import annotations

from collections import defaultdict

from ...verdict import blame
from .base import Check, Context, Kind, fmt

_ORDER = {"init": 0, "step": 1, "save": 2, "exit": 3}


def replicas(ctx: Context) -> dict[int, dict[int, dict]]:
    """rank -> DDP module index -> {"init": record with names, "points": [(step, at, record)]}."""
    out: dict[int, dict[int, dict]] = {}
    for rank, rt in ctx.run.ranks.items():
        mods: dict[int, dict] = {}
        for r in rt.records("replica"):
            m = mods.setdefault(int(r.get("id", 0) or 0), {"init": None, "points": [], "writes": []})
            if r.get("at") == "init" and m["init"] is None:
                m["init"] = r
            m["points"].append(r)
        for r in rt.records("replica_w"):
            if int(r.get("id", 0) or 0) in mods:
                mods[int(r.get("id", 0) or 0)]["writes"].append(r)
        if mods:
            out[rank] = mods
    return out


def _key(r: dict) -> tuple:
    return (int(r.get("step", 0) or 0), _ORDER.get(str(r.get("at")), 9))


class ReplicaDrift(Check):
    id = "DD013"
    category = "replica-drift"
    severity = "error"
    title = "DDP replicas differ across ranks: the ranks train different models"
    fix = ("Change a DDP model's parameters only through the optimizer step, the same on every rank: "
           "load checkpoints on every rank (or before wrapping in DDP, which broadcasts rank 0's "
           "values), never edit `model.module` parameters under a rank-dependent condition, and give "
           "every rank the same optimizer settings.")
    kinds = {"buffers": Kind(
        severity="warning", title="DDP buffers drift apart across ranks (broadcast_buffers=False)",
        fix=("Keep buffers in sync: leave broadcast_buffers=True, use SyncBatchNorm for BatchNorm "
             "statistics, or all-reduce the buffers before evaluating or saving."))}

    def run(self, ctx: Context):
        reps = ctx.shared("replicas", replicas)
        if len(reps) < 2:
            return []
        findings = []
        ids = sorted({i for mods in reps.values() for i in mods})
        for idx in ids:
            per_rank = {r: mods[idx] for r, mods in reps.items() if idx in mods and mods[idx]["init"]}
            if len(per_rank) < 2:
                continue
            names = {tuple(m["init"].get("names") or ()) for m in per_rank.values()}
            if len(names) > 1:
                continue  # different models: unseeded-rng / the ddp record's concern
            f = self._first_drift(ctx, idx, per_rank, "p", "fp")
            if f is not None:
                findings.append(f)
                continue
            bb = {bool(m["init"].get("bb", True)) for m in per_rank.values()}
            if bb == {False}:
                f = self._first_drift(ctx, idx, per_rank, "b", "bfp")
                if f is not None:
                    findings.append(f)
        return findings

    def _first_drift(self, ctx: Context, idx: int, per_rank: dict, field: str, fpkey: str):
        # the points each rank digested, by (step, kind); a save is compared with any point at its step
        by_key: dict[tuple, dict[int, dict]] = defaultdict(dict)
        for rank, m in per_rank.items():
            for r in m["points"]:
                by_key[_key(r)][rank] = r
        steps: dict[int, dict[int, dict]] = defaultdict(dict)
        for (step, _), recs in sorted(by_key.items()):
            for rank, r in recs.items():
                steps[step].setdefault(rank, r)
        last_equal: dict[int, dict] = {}
        for (step, order), recs in sorted(by_key.items()):
            cmp = dict(recs)
            if order == _ORDER["save"]:  # the other ranks' digest at the same step, if any
                for rank, r in steps[step].items():
                    cmp.setdefault(rank, r)
            if len(cmp) < 2:
                continue
            sides: dict[str, list[int]] = defaultdict(list)
            for rank, r in cmp.items():
                sides[str(r.get(fpkey))].append(rank)
            if len(sides) == 1:
                last_equal = cmp
                continue
            return self._finding(ctx, idx, per_rank, cmp, sides, last_equal, field, fpkey)
        return None

    def _finding(self, ctx, idx, per_rank, cmp, sides, last_equal, field, fpkey):
        found = blame.minority(sides)
        if found is not None:
            candidates = [(found[1], [r for r in cmp if r not in found[1]])]
        else:  # a tie: the side with a write of its own (a load, extra in-place writes) is odd
            candidates = [(rs, [r for r in cmp if r not in rs]) for rs in sides.values()]
        init = per_rank[min(per_rank)]["init"]
        names = list(init.get("names" if field == "p" else "bnames") or [])
        best = None
        for odd, major_ranks in candidates:
            r0 = odd[0]
            mine = cmp[r0]
            ref = cmp[major_ranks[0]]
            differ = [i for i, (a, b) in enumerate(zip(mine.get(field) or [], ref.get(field) or [])) if a != b]
            prev = last_equal.get(r0)
            cause, cause_loc, own = self._cause(ctx, per_rank, r0, prev, mine, ref, major_ranks[0], differ, field)
            if best is None or (own and not best[-1]):
                best = (odd, major_ranks, r0, mine, differ, prev, cause, cause_loc, own)
        odd, major_ranks, r0, mine, differ, prev, cause, cause_loc, own = best
        if found is None and not own:
            odd, major_ranks = sorted(cmp), []  # no side to blame
        dnames = [names[i] if i < len(names) else f"#{i}" for i in differ]
        step = int(mine.get("step", 0) or 0)
        at = str(mine.get("at"))
        point = {"init": "right after DDP construction", "step": f"after optimizer step {step}",
                 "save": f"when a checkpoint was saved (after step {step})",
                 "exit": f"at exit (after step {step})"}.get(at, f"at step {step}")
        since = (f"; they were equal {_point_words(prev)}" if prev is not None else "")
        what = "parameters" if field == "p" else "buffers"
        shown = ", ".join(dnames[:8]) + (f" and {len(dnames) - 8} more" if len(dnames) > 8 else "")
        against = f"on {fmt(odd)} than on {fmt(major_ranks)}" if major_ranks else f"across {fmt(odd)}"
        msg = (f"The DDP model at {ctx.where(r0, init.get('site'))} has different {what} {against} "
               f"{point}{since}: {shown or 'its ' + what} ({len(differ)} of {len(names)} differ). "
               f"What last wrote them on rank {r0}: {cause}.")
        if field == "p":
            msg += " From here on the ranks average gradients of different models."
        else:
            msg += (" With broadcast_buffers=False every rank keeps its own buffers (BatchNorm running "
                    "statistics from its own batches): evaluation and checkpoints depend on the rank.")
        # a digest taken at exit has no call site of its own: no "?:0" location for it
        locs = [loc for loc in [ctx.loc(r0, mine.get("site"), "digest")] if loc.line > 0]
        if cause_loc is not None:
            locs.insert(0, cause_loc)
        locs.append(ctx.loc(r0, init.get("site"), "ddp"))
        evidence = [[fmt(rs), f"{fpkey} {v}", f"step {cmp[rs[0]].get('step')} ({cmp[rs[0]].get('at')})"]
                    for v, rs in sides.items()]
        return self.finding(msg, odd, locs, evidence=evidence, kind=None if field == "p" else "buffers",
                            data={"module": idx, "step": step, "at": at, "names": dnames[:40],
                                  "odd": odd, "what": what})

    @staticmethod
    def _cause(ctx, per_rank, r0, prev, mine, ref, ref_rank, differ, field):
        """What wrote the differing tensors on the odd rank since the last equal digest:
        (words, location or None, whether it is a write of this rank's own)."""
        lo = int(prev.get("ts", 0) or 0) if prev is not None else -1
        hi = int(mine.get("ts", 0) or 0)
        loads = [w for w in per_rank[r0]["writes"] if lo <= int(w.get("ts", 0) or 0) <= hi]
        if loads:
            w = loads[-1]
            return (f"load_state_dict at {ctx.where(r0, w.get('site'))} (on this rank only, or with "
                    "other values)"), ctx.loc(r0, w.get("site"), "write"), True
        vkey = "pv" if field == "p" else "bv"
        if prev is not None and differ:
            pv_prev, pv_now = prev.get(vkey) or [], mine.get(vkey) or []
            # the other side's versions at the same earlier point
            ref_prev = next((r for r in per_rank[ref_rank]["points"] if _key(r) == _key(prev)), None)
            if ref_prev is not None:
                rp, rn = ref_prev.get(vkey) or [], ref.get(vkey) or []
                extra = []
                for i in differ:
                    try:
                        d_mine = int(pv_now[i]) - int(pv_prev[i])
                        d_ref = int(rn[i]) - int(rp[i])
                    except (IndexError, TypeError, ValueError):
                        continue
                    if d_mine != d_ref:
                        extra.append(d_mine - d_ref)
                if extra and max(extra) > 0:
                    return (f"an in-place write outside the optimizer ({max(extra):+d} in-place "
                            "operation(s) on these tensors compared with the other ranks: an edit of "
                            "`.data`, a `with torch.no_grad(): p.mul_()` or a `copy_` on this rank "
                            "only)"), None, True
        if field == "b":
            return ("the module's own forward passes (buffer updates from this rank's batches, never "
                    "broadcast with broadcast_buffers=False)"), None, False
        if mine.get("at") == "init":
            return "DDP construction", None, False
        return ("the optimizer step (the same number of in-place updates as on the other ranks: the "
                "gradients or the optimizer's settings or state differed)"), None, False


def _point_words(r: dict) -> str:
    at, step = r.get("at"), r.get("step")
    return {"init": "right after construction", "step": f"after step {step}"}.get(str(at), f"at step {step} ({at})")
