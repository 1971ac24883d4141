"""unseeded-rng: randomness that must agree across ranks does not.

Only the recorded points where ranks must agree are compared (``random_split`` results, a
``DistributedSampler``'s seed / dataset length / Subset indices, the parameters an optimizer
starts from, the draws from Python's and NumPy's global generators made while the program sets
up: ``_rngdraws.py``); per-rank randomness elsewhere (augmentation, dropout) is intended and never
seen.
"""

from __future__ import annotations

import os
from collections import defaultdict

from ..findings import Location
from ._records import aligned, by_value, describe, minority, site_key
from ._rngdraws import ORDERINGS, draw_findings
from .base import Check, Context, Kind, fmt


def _last_seed(seeds: list[dict], ts: int) -> dict | None:
    best = None
    for s in seeds:
        if int(s.get("ts", 0) or 0) <= ts:
            best = s
    return best


class UnseededRng(Check):
    id = "DD004"
    category = "unseeded-rng"
    severity = "error"
    title = "Randomness that must agree across ranks differs"
    fix = ("Seed what must agree identically on every rank (a fixed torch.manual_seed before building "
           "the model and splitting the data, or an explicit generator: random_split(ds, lengths, "
           "generator=torch.Generator().manual_seed(42))); keep rank-dependent seeds for augmentation only.")
    kinds = {
        "sampler": Kind(fix=("Build the sampler from the same dataset on every rank and pass the same "
                             "seed everywhere (the default, 0, or a shared constant); shard by rank "
                             "only through num_replicas/rank.")),
        "model-init": Kind(fix=("Seed identically on every rank before building the model, or wrap it "
                                "in DistributedDataParallel (or broadcast the parameters from rank 0 "
                                "once) before training.")),
        "draw": Kind(title="Python/NumPy randomness decides the set-up differently on each rank",
                     fix=("Seed random / np.random identically on every rank before the set-up (random.seed(42), "
                          "np.random.seed(42)) or draw from a generator of its own with a shared seed "
                          "(random.Random(42).shuffle(files), np.random.default_rng(42).permutation(n)); "
                          "seed per rank (seed + rank) only after the set-up, for augmentation.")),
        "draw-value": Kind(severity="warning",
                           title="Python/NumPy values drawn while setting up differ across ranks",
                           fix=("If the value decides the model or the data (a size, a split point), draw it "
                                "from a generator seeded identically on every rank, or broadcast it from rank 0.")),
        "seed": Kind(severity="info", title="Rank-dependent random seed",
                     fix="Nothing to fix if per-rank randomness is intended."),
    }

    def run(self, ctx: Context):
        seeds = {r: [s for s in rt.records("seed") if s.get("gen", "torch") == "torch"]
                 for r, rt in ctx.run.ranks.items()}
        cited: set = set()  # seed sites already named as a cause
        findings = []
        split_fps: dict[int, set] = defaultdict(set)  # rank -> digests of split parts that differ
        findings += self._splits(ctx, seeds, cited, split_fps)
        findings += self._samplers(ctx, split_fps)
        findings += self._optimizers(ctx, seeds, cited)
        ended = all((rt.exit_record() or {}).get("how") == "normal" for rt in ctx.run.ranks.values())
        draws = draw_findings(self, ctx, cited, clean=not findings and ended)  # Python / NumPy set-up draws
        _name_draws_as_cause(findings, draws)
        findings += draws
        findings += self._seeds(ctx, cited, clean=not findings)
        return findings

    # -- causes -----------------------------------------------------------------------------------
    def _seed_cause(self, ctx: Context, seeds: dict, at: dict[int, int], cited: set) -> tuple[str, list]:
        """The torch.manual_seed calls in effect at these moments, when their values differ."""
        last = {r: _last_seed(seeds.get(r, []), ts) for r, ts in at.items()}
        vals = by_value({r: (s.get("value") if s else None) for r, s in last.items()})
        if len(vals) < 2:
            if all(s is None for s in last.values()):
                return " The default torch generator was not seeded with torch.manual_seed: its state " \
                       "depends on what each rank drew from it before.", []
            return " The seeds are the same, so the ranks consumed different amounts of randomness " \
                   "from the generator before this point.", []
        r0 = next(r for r, s in last.items() if s is not None)
        s0 = last[r0]
        cited.add(site_key(ctx, r0, s0.get("site")))
        shown = describe(vals, lambda v: "not seeded" if v is None else str(v))
        return (f" Cause: torch.manual_seed at {ctx.where(r0, s0.get('site'))} seeds the default generator "
                f"with a different value per rank ({shown})."), [ctx.loc(r0, s0.get("site"), "seed")]

    # -- random_split -----------------------------------------------------------------------------
    def _splits(self, ctx: Context, seeds: dict, cited: set, split_fps: dict) -> list:
        out = []
        sampler_data = defaultdict(set)
        for r, rt in ctx.run.ranks.items():
            for s in rt.records("sampler"):
                if s.get("data_fp") and int(s.get("replicas", 1) or 1) > 1:
                    sampler_data[r].add(s["data_fp"])
        for key, per_rank in aligned(ctx, "split").items():
            if len(per_rank) < 2:
                continue
            groups = by_value({r: tuple(rec.get("fp") or ()) for r, rec in per_rank.items()})
            if len(groups) < 2:
                continue
            r0 = min(per_rank)
            rec0 = per_rank[r0]
            for r, rec in per_rank.items():
                split_fps[r].update(rec.get("fp") or ())
            feeds = sorted(r for r, rec in per_rank.items() if sampler_data[r] & set(rec.get("fp") or ()))
            explicit = rec0.get("gen") == "explicit"
            gen = "the generator passed to it" if explicit else "the default torch generator"
            names = {v: f"split {chr(ord('A') + i) if i < 26 else i}" for i, v in enumerate(groups)}
            msg = (f"random_split at {ctx.where(r0, rec0.get('site'))} splits {rec0.get('n')} samples into "
                   f"parts of {rec0.get('parts')} differently on different ranks ({len(groups)} distinct "
                   f"splits: {describe(groups, names.get)}); it draws from {gen}.")
            if len(rec0.get("parts") or ()) > 1:
                msg += (" The parts overlap across ranks: samples in one rank's first part are in another "
                        "rank's second, so held-out (validation) data leaks into training.")
            locs = [ctx.loc(r0, rec0.get("site"), "split")]
            if feeds:
                msg += (f" A DistributedSampler shards these parts on {fmt(feeds)}: each rank takes its "
                        f"shard of a different index list, so some samples are seen by several ranks and "
                        f"others by none.")
            if not explicit:
                cause, clocs = self._seed_cause(ctx, seeds, {r: int(rec.get("ts", 0) or 0)
                                                              for r, rec in per_rank.items()}, cited)
                msg += cause
                locs += clocs
            out.append(self.finding(msg, minority(groups) if not feeds else sorted(per_rank), locs,
                                    severity="error" if feeds else "warning",
                                    evidence=[[fmt(rs), "parts " + "/".join(v), ctx.where(rs[0], per_rank[rs[0]].get("site"))]
                                              for v, rs in groups.items()],
                                    data={"what": "split", "site": list(key[:2]), "generator": rec0.get("gen"),
                                          "distinct": len(groups), "feeds_sampler": feeds}))
        return out

    # -- DistributedSampler -----------------------------------------------------------------------
    def _samplers(self, ctx: Context, split_fps: dict) -> list:
        out = []
        firsts: dict[int, list[dict]] = {}
        for r, rt in ctx.run.ranks.items():
            seen: dict = {}
            for s in rt.records("sampler"):
                seen.setdefault(s.get("id"), s)  # one record per sampler instance: its first epoch
            firsts[r] = list(seen.values())

        def site_of(rec: dict):
            return rec.get("created") if rec.get("created") is not None else rec.get("site")

        for key, per_rank in aligned(ctx, "sampler", site_of, lambda rt: firsts[rt.rank]).items():
            per_rank = {r: s for r, s in per_rank.items() if int(s.get("replicas", 1) or 1) > 1}
            for ranks in by_value({r: s.get("replicas") for r, s in per_rank.items()}).values():
                if len(ranks) < 2:
                    continue
                sub = {r: per_rank[r] for r in ranks}
                f = self._sampler_finding(ctx, key, sub, split_fps)
                if f is not None:
                    out.append(f)
        return out

    def _sampler_finding(self, ctx: Context, key, sub: dict[int, dict], split_fps: dict):
        r0 = min(sub)
        s0 = sub[r0]
        where = ctx.where(r0, s0.get("created") if s0.get("created") is not None else s0.get("site"))
        problems, evidence, blame = [], [], set()
        shuffle = any(s.get("shuffle") for s in sub.values())
        checks = [("n", "dataset length", "the ranks shard index lists of different lengths, so they "
                   "disagree on the number of samples per rank and batches per epoch")]
        if shuffle:
            checks.insert(0, ("seed", "seed", "each rank shuffles with a different permutation, so the "
                              "shards overlap: some samples are seen by several ranks per epoch, others by none"))
        checks.append(("data_fp", "Subset indices", "the ranks' datasets hold different samples, so the "
                       "shards are taken from different index lists"))
        for field, label, why in checks:
            groups = by_value({r: s.get(field) for r, s in sub.items()})
            if len(groups) < 2:
                continue
            if field == "data_fp" and all(s.get("data_fp") in split_fps.get(r, ()) for r, s in sub.items()):
                continue  # a random_split reported above produced these subsets
            problems.append(f"{label} differs ({describe(groups)}): {why}")
            blame.update(minority(groups))
            evidence.extend([fmt(rs), f"{label} {v}", where] for v, rs in groups.items())
        if not problems:
            return None
        msg = (f"The DistributedSampler created at {where} does not agree across ranks: "
               + "; ".join(problems) + ".")
        locs: list[Location] = [ctx.loc(r0, s0.get("created") if s0.get("created") is not None
                                        else s0.get("site"), "sampler")]
        return self.finding(msg, sorted(blame), locs, evidence=evidence, kind="sampler",
                            data={"what": "sampler", "site": list(key[:2]),
                                  "subset": any(p.startswith("Subset indices") for p in problems)})

    # -- optimizers (model initialisation) --------------------------------------------------------
    def _optimizers(self, ctx: Context, seeds: dict, cited: set) -> list:
        out = []
        chosen: dict[int, list[dict]] = {}
        for r, rt in ctx.run.ranks.items():
            per_id: dict = {}
            for o in rt.records("optim"):
                ent = per_id.setdefault(o.get("id", id(o)), {})
                ent.setdefault(o.get("at", "init"), o)
            recs = []
            for ent in per_id.values():
                init = ent.get("init")
                step = ent.get("step")
                rec = dict(step or init)
                rec["_align"] = (init or step).get("site")
                rec["_init"] = init
                rec["_stepped"] = step is not None
                recs.append(rec)
            chosen[r] = recs
        for key, per_rank in aligned(ctx, "optim", lambda rec: rec["_align"],
                                     lambda rt: chosen[rt.rank]).items():
            if len(per_rank) < 2 or any(int(o.get("in_ddp", 0) or 0) or o.get("sharded")
                                        for o in per_rank.values()):
                continue  # DDP broadcasts the weights; FSDP/DTensor shards differ by design
            if len({(o.get("cls"), o.get("nparams")) for o in per_rank.values()}) > 1:
                continue  # different models per rank (pipeline stages): nothing to compare
            if _wrapped_after(ctx, per_rank):
                continue  # optimizer built before the DDP wrapping (nanoGPT): DDP broadcast them
            groups = by_value({r: o.get("fp") for r, o in per_rank.items()})
            if len(groups) < 2 or "?" in groups:
                continue
            r0 = min(per_rank)
            o0 = per_rank[r0]
            stepped = all(o["_stepped"] for o in per_rank.values())
            gfps = by_value({r: o.get("gfp") for r, o in per_rank.items()})
            synced = stepped and len(gfps) == 1 and "none" not in gfps and "?" not in gfps
            site = ctx.site(r0, o0["_align"])
            where = f"{os.path.basename(str(site.get('file', '?')))}:{site.get('line', 0)}"
            names = {v: f"init {chr(ord('A') + i) if i < 26 else i}" for i, v in enumerate(groups)}
            msg = (f"The {o0.get('cls')} optimizer created at {where} trains parameters that differ across "
                   f"ranks ({len(groups)} distinct initialisations: {describe(groups, names.get)}), and the model is "
                   f"not wrapped in DistributedDataParallel, which would broadcast rank 0's parameters.")
            if synced:
                msg += (" The gradients are identical on every rank at the first step, so the program "
                        "averages them across ranks: it means to train one model, but each rank applies "
                        "the averaged gradients to its own weights, and the replicas never agree.")
                sev = "error"
            elif stepped:
                msg += (" The gradients differ across ranks too, so each rank trains its own model; "
                        "if they are meant to be one model, this is why they disagree.")
                sev = "info"
            else:
                msg += " If the ranks are meant to train one model, they start from different weights."
                sev = "info"
            at = {r: int((o["_init"] or o).get("ts", 0) or 0) for r, o in per_rank.items()}
            cause, clocs = self._seed_cause(ctx, seeds, at, cited)
            msg += cause
            locs = [ctx.loc(r0, o0["_align"], "optimizer")] + clocs
            out.append(self.finding(msg, minority(groups), locs, severity=sev, kind="model-init",
                                    evidence=[[fmt(rs), f"parameter digest {v}", where] for v, rs in groups.items()],
                                    data={"what": "model-init", "site": list(key[:2]), "grads_synced": synced}))
        return out

    # -- seeds ------------------------------------------------------------------------------------
    def _seeds(self, ctx: Context, cited: set, clean: bool) -> list:
        out = []
        per_item = _library_per_item_seeds(ctx)
        for key, per_rank in aligned(ctx, "seed").items():
            if len(per_rank) < 2 or key[:2] in cited or key[:2] in per_item:
                continue
            groups = by_value({r: _hashable(s.get("value")) for r, s in per_rank.items()})
            if len(groups) < 2:
                continue
            r0 = min(per_rank)
            s0 = per_rank[r0]
            seeder, gen = _SEEDERS.get(str(s0.get("gen", "torch")), _SEEDERS["torch"])
            msg = (f"{seeder} at {ctx.where(r0, s0.get('site'))} seeds {gen} with "
                   f"a different value on each rank ({describe(groups)}). That is right for augmentation "
                   f"and dropout, wrong for anything that must agree across ranks (model initialisation, "
                   f"data splits, shuffled index lists).")
            if clean:
                msg += (" Nothing recorded that must agree (splits, samplers, the parameters optimizers "
                        "start from, Python/NumPy draws while setting up) came out different.")
            out.append(self.finding(msg, sorted(per_rank), [ctx.loc(r0, s0.get("site"), "seed")],
                                    kind="seed", data={"what": "seed", "site": list(key[:2])}))
        return out


def _name_draws_as_cause(findings: list, draws: list) -> None:
    """A sampler over Subsets that differ across ranks, in a run where set-up shuffles or
    permutations from Python/NumPy differed too: one of those draws probably built the indices."""
    orderings = [d for d in draws if d.data.get("fn") in ORDERINGS and d.data.get("what") == "draw"][:3]
    if not orderings:
        return
    named = ", ".join(f"{'np.random.' if d.data.get('gen') == 'numpy' else 'random.'}{d.data.get('fn')} at "
                      f"{os.path.basename(d.locations[0].file)}:{d.locations[0].line}" for d in orderings)
    for f in findings:
        if f.data.get("what") == "sampler" and f.data.get("subset"):
            f.message += (f" Python/NumPy randomness drawn while setting up differs across ranks too ({named}, "
                          f"reported separately): if it built these indices, it is the cause.")
            for d in orderings:
                loc = d.locations[0]
                f.locations.append(Location(loc.rank, loc.file, loc.line, loc.function, loc.source, "draw"))


#: seed record ``gen`` -> (the call, the generator it seeds), for messages.
_SEEDERS = {"torch": ("torch.manual_seed", "the default generator"),
            "python": ("random.seed", "Python's global generator"),
            "numpy": ("np.random.seed", "NumPy's global generator"),
            "numpy_rng": ("np.random.default_rng", "a NumPy Generator")}


def _hashable(v) -> object:
    """A seed value as a dict key (a damaged trace may hold a list)."""
    return v if v is None or isinstance(v, (int, float, str)) else repr(v)


def _wrapped_after(ctx: Context, per_rank: dict) -> bool:
    """Whether every rank wrapped this optimizer's parameters in DistributedDataParallel after
    building the optimizer (its ``in_ddp`` counted 0 then): a ``ddp`` record whose parameters
    before the broadcast are the optimizer's (same fingerprint, else same count). DDP overwrites
    them in place with rank 0's, so the optimizer trains the same weights on every rank."""
    for r, o in per_rank.items():
        fp, n = o.get("fp"), o.get("nparams")
        if not any(d.get("init_fp") == fp or (n is not None and d.get("nparams") == n)
                   for d in ctx.run.ranks[r].records("ddp")):
            return False
    return True


def _library_per_item_seeds(ctx: Context) -> set[tuple]:
    """Sites ``(file, line)`` where library code (the site has ``via``: a dataset of torchvision
    seeding per sample, say) seeds the generator more than once per rank: a seed per item, a
    function of the item, not of the rank. That the ranks' items differ is the sampler's job."""
    counts: dict[tuple, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    via: set[tuple] = set()
    for r, rt in ctx.run.ranks.items():
        for s in rt.records("seed"):
            site = ctx.site(r, s.get("site"))
            key = (site.get("file", "?"), int(site.get("line", 0) or 0))
            counts[key][r] += 1
            if site.get("via"):
                via.add(key)
    return {k for k in via if all(n > 1 for n in counts[k].values())}
