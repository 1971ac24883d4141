"""nonfinite-gradients: a NaN/Inf that some ranks' local gradients held, averaged by DDP into every
replica.

Each rank records (``grad_nf``, ``rank/patches/grads.py``) a backward whose gradient at the DDP
model's output was non-finite on that rank (``local``: before the average; ``pnf`` when its
parameters were already non-finite), then what became of it on that rank (an optimizer step
that applied non-finite gradients, ``apply``; ``skip`` with ``how``: no optimizer step before the
next backward, a GradScaler skip, finite gradients at the step) and, at exit, whether its
parameters hold non-finite values. The first backward where some ranks' local gradients were
non-finite while their parameters were still finite is the origin. It is an error when some rank
applied the averaged gradients (an ``apply`` record, or parameters that are non-finite later);
info when every rank skipped the step and the parameters stayed finite (what GradScaler does).
"""

from __future__ import annotations

from collections import defaultdict

from .base import Check, Context, Kind, fmt


def _by_module(ctx: Context) -> dict[int, dict[int, list[dict]]]:
    out: dict[int, dict[int, list[dict]]] = defaultdict(dict)
    for rank, rt in ctx.run.ranks.items():
        for r in rt.records("grad_nf"):
            out[_int(r.get("id"))].setdefault(rank, []).append(r)
    return out


def _int(v) -> int:
    try:
        return int(v or 0)
    except (TypeError, ValueError):
        return 0


def _step(r: dict) -> int:
    return _int(r.get("step"))


class NonfiniteGradients(Check):
    id = "DD015"
    category = "nonfinite-gradients"
    severity = "error"
    title = "Non-finite gradients of some ranks were averaged into every DDP replica and applied"
    fix = ("Decide to skip a step from values that are the same on every rank: the averaged gradients "
           "after backward (`torch.amp.GradScaler` does this), or a flag all-reduced across ranks; "
           "find and drop the bad samples (NaN/Inf in inputs or labels) or guard the loss (log of 0, "
           "division by 0) before backward.")
    kinds = {
        "skipped": Kind(severity="info",
                        title="Non-finite gradients on some ranks; the step was skipped on every rank",
                        fix="Nothing to change if this is rare; otherwise find the samples or the loss "
                            "term that produce NaN/Inf on these ranks."),
        "params": Kind(title="DDP parameters became non-finite: an optimizer step applied NaN/Inf",
                       fix=("Check the gradients after backward (they are the same on every rank) before "
                            "stepping, e.g. with `torch.amp.GradScaler`, or clip and skip on a flag "
                            "all-reduced across ranks; look for an overflow inside the model's backward "
                            "(mixed precision without loss scaling, sqrt/log at 0).")),
    }

    def run(self, ctx: Context):
        findings = []
        for idx, per_rank in sorted(_by_module(ctx).items()):
            f = self._module(ctx, idx, per_rank)
            if f is not None:
                findings.append(f)
        return findings

    def _module(self, ctx: Context, idx: int, per_rank: dict[int, list[dict]]):
        origins = [(_step(r), rank, r) for rank, recs in per_rank.items() for r in recs
                   if r.get("at") == "local" and not r.get("pnf")]
        if not origins:
            return self._params_only(ctx, idx, per_rank)
        first = min(s for s, _, _ in origins)
        local = {rank: r for s, rank, r in origins if s == first}
        applied: dict[int, str] = {}
        skipped: dict[int, str] = {}
        apply_loc = None
        for rank, recs in per_rank.items():
            for r in recs:
                at, s = r.get("at"), _step(r)
                if at == "apply" and s == first:
                    applied[rank] = f"an optimizer step applied {r.get('n', '?')} non-finite gradient(s)"
                    if apply_loc is None:
                        apply_loc = ctx.loc(rank, r.get("site"), "step")
                elif at == "skip" and s == first:
                    skipped[rank] = {"none": "no optimizer step", "scaler": "GradScaler skipped the step",
                                     "finite": "its gradients were finite at the step"}.get(
                                         str(r.get("how")), "skipped")
            if rank in applied:
                continue
            later = sorted(_step(r) for r in recs if r.get("at") == "local" and r.get("pnf") and _step(r) > first)
            if later:
                applied[rank] = f"its parameters were non-finite at backward {later[0]}"
            elif any(r.get("at") == "exit" and r.get("pnf") for r in recs):
                applied[rank] = "its parameters were non-finite at exit"
        r0 = min(local)
        site = local[r0].get("site")
        kinds = sorted({str(r.get("kind", "nonfinite")) for r in local.values()})
        what = "/".join({"nan": "NaN", "inf": "Inf"}.get(k, "non-finite values") for k in kinds)
        head = (f"At backward #{first} of the DDP model run at {ctx.where(r0, site)}, the gradient reaching "
                f"the model's output held {what} on {fmt(local)} only: the local gradients of "
                f"{'that rank' if len(local) == 1 else 'those ranks'}, which DDP averaged into every replica.")
        locs = [ctx.loc(r0, site, "backward")]
        evidence = [[f"rank {r}", "local gradients non-finite" if r in local else "local gradients finite",
                     applied.get(r) or skipped.get(r) or "no record"] for r in sorted(per_rank)]
        data = {"module": idx, "step": first, "local": sorted(local), "applied": sorted(applied),
                "skipped": sorted(skipped)}
        if applied:
            parts = "; ".join(f"rank {r}: {why}" for r, why in sorted(applied.items()))
            msg = head + f" The non-finite average was then applied on {fmt(applied)} ({parts})."
            if skipped:
                msg += (f" {fmt(skipped).capitalize()} skipped the step "
                        f"({'; '.join(f'rank {r}: {why}' for r, why in sorted(skipped.items()))}): "
                        "the decision to skip was taken from per-rank values, after the average.")
            if apply_loc is not None:
                locs.append(apply_loc)
            return self.finding(msg, sorted(set(local) | set(applied)), locs, evidence=evidence, data=data)
        how = "; ".join(f"rank {r}: {why}" for r, why in sorted(skipped.items())) or "no step recorded"
        msg = head + f" The step was skipped ({how}) and the parameters stayed finite."
        return self.finding(msg, sorted(local), locs, evidence=evidence, data=data, kind="skipped")

    def _params_only(self, ctx: Context, idx: int, per_rank: dict[int, list[dict]]):
        """Parameters found non-finite with no backward whose output gradient showed it first:
        the NaN/Inf arose inside backward (or came from a load) and was applied."""
        seen = {}
        for rank, recs in per_rank.items():
            steps = [_step(r) for r in recs if r.get("at") == "local" and r.get("pnf")]
            if steps:
                seen[rank] = (min(steps), next(r for r in recs if r.get("at") == "local" and r.get("pnf")))
            elif any(r.get("at") == "exit" and r.get("pnf") for r in recs):
                seen[rank] = (None, None)
        if not seen:
            return None
        when = [s for s, _ in seen.values() if s is not None]
        r0 = min(seen)
        rec = seen[r0][1]
        point = f"at backward {min(when)}" if when else "at exit"
        msg = (f"The parameters of DDP model #{idx} hold NaN/Inf on {fmt(seen)} ({point}), though no "
               "backward showed a non-finite gradient at the model's output first: the non-finite "
               "values arose inside backward (an overflow, sqrt/log at 0) or were loaded, and an "
               "optimizer step applied them.")
        locs = [ctx.loc(r0, rec.get("site"), "backward")] if rec is not None else []
        return self.finding(msg, sorted(seen), locs, kind="params",
                            data={"module": idx, "step": min(when) if when else None})
