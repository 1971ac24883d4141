"""sampler-misuse: a DistributedSampler used in a way that silently skews the data.

From the ``sampler`` records (one per iteration of a sampler: epoch, seed, shuffle, dataset
length, replicas, drop_last) and ``set_epoch`` records:

* shuffled iterations that repeat the same (seed, epoch) on the same sampler (or on samplers
  rebuilt at the same line) without ``set_epoch`` advancing: the same order every epoch;
* the same iteration of a shuffled sampler with different epochs on different ranks: the ranks
  shard different permutations, so samples are seen twice or not at all;
* an evaluation sampler (shuffle=False, drop_last=False) over a dataset whose length is not a
  multiple of the number of replicas: it pads with duplicates, counted twice in metrics.
"""

from __future__ import annotations

from collections import defaultdict

from ._records import aligned, by_value, describe, minority
from .base import Check, Context, Kind, fmt


def _created(rec: dict):
    return rec.get("created") if rec.get("created") is not None else rec.get("site")


class SamplerMisuse(Check):
    id = "DD007"
    category = "sampler-misuse"
    severity = "warning"
    title = "DistributedSampler misuse"
    fix = "Call sampler.set_epoch(epoch) at the start of every epoch, on every rank, with the same epoch."
    kinds = {
        "no-set-epoch": Kind(title="DistributedSampler without set_epoch: same order every epoch"),
        "epoch-mismatch": Kind(severity="error", title="DistributedSampler epochs differ across ranks",
                               fix="Call sampler.set_epoch(epoch) with the same epoch number on every rank."),
        "padding": Kind(title="Evaluation sampler pads with duplicate samples",
                        fix=("Evaluate the remainder separately, drop the padded predictions after "
                             "gathering (keep the first len(dataset)), or use drop_last=True where "
                             "losing the remainder is acceptable.")),
    }

    def run(self, ctx: Context):
        findings = []
        findings += self._same_order(ctx)
        findings += self._epoch_mismatch(ctx)
        findings += self._padding(ctx)
        return findings

    # -- same order every epoch -------------------------------------------------------------------
    def _same_order(self, ctx: Context) -> list:
        # (creation file, line) -> {"ranks", "iters", "epochs", "set_epoch", "first": (rank, rec)}
        sites: dict[tuple, dict] = {}
        for rank, rt in ctx.run.ranks.items():
            set_epochs: dict = defaultdict(set)
            for s in rt.records("set_epoch"):
                set_epochs[s.get("id")].add(s.get("epoch"))
            per_site: dict[tuple, list] = defaultdict(list)
            for rec in rt.records("sampler"):
                if not rec.get("shuffle"):
                    continue  # order is fixed by design
                c = ctx.site(rank, _created(rec))
                per_site[(c.get("file"), c.get("line"))].append(rec)
            for key, recs in per_site.items():
                advancing = any(len(set_epochs.get(r.get("id"), ())) > 1 for r in recs)
                if advancing:
                    continue  # epochs do advance: repeated iterations within an epoch are deliberate
                seen: dict = defaultdict(int)
                for r in recs:
                    # Per iterating line: a peek (`next(iter(loader))` before the loop) is no epoch.
                    it = ctx.site(rank, r.get("site"))
                    seen[(r.get("seed"), r.get("epoch"), r.get("n"), r.get("data_fp"),
                          it.get("file"), it.get("line"))] += 1
                repeats = max(seen.values())
                if repeats < 2:
                    continue
                ent = sites.setdefault(key, {"ranks": [], "iters": 0, "epochs": set(), "called": False,
                                             "instances": set(), "first": (rank, recs[0])})
                ent["ranks"].append(rank)
                ent["iters"] = max(ent["iters"], repeats)
                ent["epochs"].update(r.get("epoch") for r in recs)
                ent["called"] |= any(r.get("id") in set_epochs for r in recs)
                ent["instances"].add(len({r.get("id") for r in recs}))
        out = []
        for ent in sites.values():
            rank, rec = ent["first"]
            where = ctx.where(rank, _created(rec))
            epochs = sorted(e for e in ent["epochs"] if e is not None)
            if ent["called"]:
                how = f"set_epoch is called, but always with {epochs[0] if epochs else 'the same value'}"
            elif max(ent["instances"]) > 1:
                how = "the sampler is rebuilt for each pass and never gets set_epoch"
            else:
                how = "set_epoch is never called"
            msg = (f"The shuffled DistributedSampler created at {where} is iterated {ent['iters']} times with "
                   f"the same seed and epoch ({how}) on {fmt(ent['ranks'])}: every epoch visits the samples "
                   f"in the same order, which defeats shuffling.")
            out.append(self.finding(msg, ent["ranks"], [ctx.loc(rank, _created(rec), "sampler"),
                                                        ctx.loc(rank, rec.get("site"), "iteration")],
                                    kind="no-set-epoch", data={"what": "no-set-epoch", "iterations": ent["iters"]}))
        return out

    # -- epochs that differ across ranks ----------------------------------------------------------
    def _epoch_mismatch(self, ctx: Context) -> list:
        out = []
        # iterations per creation line and rank: where ranks iterate a different number of times
        # the n-th iterations do not correspond, and comparing them would blame the wrong thing
        totals: dict[tuple, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        for rank, rt in ctx.run.ranks.items():
            for rec in rt.records("sampler"):
                c = ctx.site(rank, _created(rec))
                totals[(c.get("file"), int(c.get("line", 0) or 0))][rank] += 1
        for key, per_rank in aligned(ctx, "sampler", _created).items():
            if len(set(totals[key[:2]].values())) > 1:
                continue
            per_rank = {r: s for r, s in per_rank.items()
                        if s.get("shuffle") and int(s.get("replicas", 1) or 1) > 1}
            if len(per_rank) < 2:
                continue
            groups = by_value({r: s.get("epoch") for r, s in per_rank.items()})
            if len(groups) < 2:
                continue
            r0 = min(per_rank)
            s0 = per_rank[r0]
            msg = (f"The shuffled DistributedSampler created at {ctx.where(r0, _created(s0))} is iterated with "
                   f"different epochs on different ranks ({describe(groups)}): each rank takes its shard of "
                   f"a different permutation, so that epoch some samples are seen by several ranks and "
                   f"others by none.")
            out.append(self.finding(msg, minority(groups), [ctx.loc(r0, _created(s0), "sampler"),
                                                            ctx.loc(r0, s0.get("site"), "iteration")],
                                    kind="epoch-mismatch", data={"what": "epoch-mismatch",
                                          "epochs": {str(k): v for k, v in groups.items()}}))
            break  # the first mismatch is the one to fix; later ones follow from it
        return out

    # -- padding of evaluation samplers -----------------------------------------------------------
    def _padding(self, ctx: Context) -> list:
        """Warning, not error: the duplicates only distort what is summed over the data (metrics)."""
        sites: dict[tuple, dict] = {}
        for rank, rt in ctx.run.ranks.items():
            for rec in rt.records("sampler"):
                if rec.get("shuffle") or rec.get("drop_last"):
                    continue
                n = int(rec.get("n", 0) or 0)
                replicas = int(rec.get("replicas", 1) or 1)
                if replicas < 2 or n % replicas == 0:
                    continue
                c = ctx.site(rank, _created(rec))
                key = (c.get("file"), c.get("line"), n, replicas)
                ent = sites.setdefault(key, {"ranks": set(), "first": (rank, rec)})
                ent["ranks"].add(rank)
        out = []
        for (_f, _l, n, replicas), ent in sites.items():
            rank, rec = ent["first"]
            per = -(-n // replicas)
            dup = per * replicas - n
            # DistributedSampler appends the first `dup` indices; the last `dup` ranks get them.
            padded = list(range(replicas - dup, replicas))
            msg = (f"The DistributedSampler created at {ctx.where(rank, _created(rec))} (shuffle=False, "
                   f"drop_last=False) splits {n} samples over {replicas} replicas: {n} is not a multiple of "
                   f"{replicas}, so it pads to {per * replicas} with {dup} duplicate sample(s) (given to "
                   f"{fmt(padded)}). If it feeds evaluation, metrics summed or averaged over the ranks count those samples "
                   f"twice.")
            out.append(self.finding(msg, sorted(ent["ranks"]), [ctx.loc(rank, _created(rec), "sampler")],
                                    kind="padding", data={"what": "padding", "n": n, "replicas": replicas, "duplicates": dup}))
        return out
