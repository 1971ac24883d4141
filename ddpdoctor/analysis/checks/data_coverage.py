"""data-coverage: within a pass over the data (an epoch), the ranks' samples should partition it.

From the ``cov`` records (one per pass over a DataLoader per rank: the base-dataset indices it
drew, see rank/patches/coverage.py) and the ``file`` reads made while a DataLoader drew a batch
(``dl``). Passes are matched across ranks by the line that created the loader and the number of
the pass on that line.

* indices: ranks whose shards overlap beyond DistributedSampler's padding (error under a
  DistributedSampler, warning for other samplers), a DistributedSampler fed datasets of different
  lengths, shards of a DistributedSampler that leave samples out (beyond drop_last), and every
  rank drawing the very same samples (warning when a DDP model trains on them, info otherwise);
* files (IterableDatasets that shard by hand): every rank reading the same files, or files read
  by several ranks in one pass (with the files no rank read that pass but another pass did);
* batches (IterableDatasets, whatever their source): ranks of one DDP model whose pass began
  with the very same batches (the fingerprints of the first few), while the model trained.

Quiet by design: samplers with replacement, passes over datasets whose identity differs across
ranks (per-rank data: indices mean different samples), ranks sharing one shard of a
DistributedSampler (same ``rank`` argument: tensor/pipeline parallel peers), padding and
drop_last, and the missing part of a pass a rank left early (Join, early stopping).
"""

from __future__ import annotations

import os
from collections import defaultdict

from ..findings import Location
from ._coverage import at_rate, compare, decode, order_line
from ._records import by_value, describe, site_key
from .base import Check, Context, Kind, fmt


def _ddp_spans(ctx: Context, ranks) -> bool:
    """Whether one DDP module's group holds at least two of ``ranks`` (they train one model, so
    their data should differ)."""
    want = set(ranks)
    world = set(ctx.run.ranks)
    for rank, rt in ctx.run.ranks.items():
        members = {p.get("g"): set(p.get("ranks") or ()) for p in rt.records("pg") if p.get("ranks")}
        for d in rt.records("ddp"):
            g = d.get("g", "0")
            m = world if g == "0" else members.get(g, {rank})
            if len(m & want) >= 2:
                return True
    return False


def _report_order(found: tuple) -> tuple:
    key = found[0]
    return str(key[0]), key[1], key[2] if isinstance(key[2], tuple) else ("pass", key[2])


def _label(tag) -> str:
    """("epoch", 3) -> "epoch 3"; ("pass", 0) -> "pass 1"."""
    return f"epoch {tag[1]}" if tag[0] == "epoch" else f"pass {tag[1] + 1}"


def _int(v, default: int | None = 0) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else default


def _clean(rec: dict) -> dict | None:
    """A ``cov`` record with the types the check relies on (a corrupt or hostile trace gives a
    partial result, never an exception): None when it cannot be placed."""
    it = _int(rec.get("it"), None)
    if it is None or it < 0:
        return None
    out = dict(rec)
    for k in ("full", "steps", "u", "k", "nb"):
        out[k] = _int(rec.get(k))
    out["n"] = _int(rec.get("n"), None)
    out["ep"] = _int(rec.get("ep"), None)
    out["rate"] = min(max(_int(rec.get("rate")) or 0, 0), 23)
    d = rec.get("dist")
    if d is not None:
        ok = isinstance(d, list) and len(d) == 4 and all(_int(v, None) is not None for v in (d[0], d[1], d[3]))
        out["dist"] = [d[0], d[1], bool(d[2]), d[3]] if ok else None
        if not ok:
            out.pop("ix", None)  # a DistributedSampler whose settings are unreadable: not compared
    for k in ("kind", "smp", "dk", "fp"):
        if not isinstance(out.get(k), (str, type(None))):
            out[k] = None
    return out


def _splits_differ(ctx: Context) -> bool:
    """``random_split`` gave the ranks different parts (unseeded-rng, DD004, reports it): Subsets
    cut from them differ as a consequence."""
    if not ctx.enabled("DD004"):
        return False
    per_rank = {r: tuple(tuple(str(x) for x in (s.get("fp") or ())) for s in rt.records("split")
                         if isinstance(s.get("fp"), list)) for r, rt in ctx.run.ranks.items()}
    return any(per_rank.values()) and len(set(per_rank.values())) > 1


#: Samplers that draw every index of the dataset they are given (without replacement).
_WHOLE = frozenset({"RandomSampler", "SequentialSampler"})


def _scale(n: int, rate: int) -> str:
    return str(n) if not rate else f"about {n << rate}"


class DataCoverage(Check):
    id = "DD017"
    category = "data-coverage"
    severity = "error"
    title = "Ranks' data shards overlap or leave samples out"
    fix = ("Shard one common order: the same dataset and the same seed on every rank, then "
           "DistributedSampler (with set_epoch) or files[rank::world] after a shuffle with a "
           "generator seeded the same on every rank.")
    kinds = {
        "overlap": Kind(title="DistributedSampler shards overlap across ranks"),
        "lengths": Kind(title="DistributedSampler sees datasets of different lengths on different ranks",
                        fix=("Build the dataset the same way on every rank (no rank-dependent filter or "
                             "split) before handing it to DistributedSampler.")),
        "sampler-overlap": Kind(severity="warning", title="Ranks draw overlapping samples in the same epoch"),
        "missing": Kind(severity="warning", title="DistributedSampler shards leave samples out",
                        fix="Give every rank the same sampler settings (num_replicas = world size, each rank its own rank)."),
        "whole": Kind(severity="warning", title="Every rank draws the whole dataset (no DistributedSampler)",
                      fix=("Pass sampler=DistributedSampler(dataset) to the DataLoader (and call "
                           "set_epoch each epoch), or shard the data by rank.")),
        "same-files": Kind(severity="warning", title="Every rank reads the same data files in an epoch",
                           fix="Give each rank its shard of the files: files[rank::world] of one common order."),
        "file-overlap": Kind(severity="warning", title="Ranks read overlapping data files in the same epoch"),
        "same-batches": Kind(severity="warning", title="Every rank gets the same batches from an IterableDataset",
                             fix=("Shard the stream by rank inside the IterableDataset (take every world_size-th "
                                  "sample from the rank-th, e.g. itertools.islice(stream, rank, None, world_size); "
                                  "datasets' split_dataset_by_node; webdataset's split_by_node), or use a "
                                  "map-style dataset with DistributedSampler.")),
    }

    def run(self, ctx: Context):
        passes, raw = self._passes(ctx)
        out = []
        seen: dict[tuple, object] = {}
        found = [(key, f) for key, per_rank in passes.items() for f in self._indices(ctx, key, per_rank)]
        found += [(key, f) for key, per_rank in raw.items() for f in self._files(ctx, key, per_rank)]
        by_files = {key for key, f in found if f.data.get("what") == "same-files"}  # more specific
        found += [(key, f) for key, per_rank in raw.items() if key not in by_files
                  for f in self._batches(ctx, key, per_rank)]
        for key, f in sorted(found, key=_report_order):
            # the same finding every epoch: reported once, with the number of passes
            first = seen.get((f.data.get("what"), key[:2]))
            if first is not None:
                first.data["passes"] += 1
                continue
            f.data["passes"] = 1
            seen[(f.data.get("what"), key[:2])] = f
            out.append(f)
        return out

    @staticmethod
    def _passes(ctx: Context) -> tuple[dict, dict]:
        """The passes to compare, {(loader file, line, label): {rank: cov record}}, and the raw ones
        by pass number, {(loader file, line, it): {rank: record}} (what file reads name). Labels:
        ``("epoch", e)`` when every pass from that line has its sampler's epoch (a rank's several
        passes in one epoch: its fullest), else ``("pass", n)`` counted without a rank's peeks
        (at most two batches of a pass left early, followed by another pass)."""
        raw: dict[tuple, dict[int, dict]] = defaultdict(dict)
        by_line: dict[tuple, dict[int, list]] = defaultdict(lambda: defaultdict(list))
        for rank, rt in ctx.run.ranks.items():
            for rec in rt.records("cov"):
                c = _clean(rec)
                if c is None:
                    continue
                f, line = site_key(ctx, rank, c.get("created"))
                raw[(f, line, c["it"])][rank] = c
                by_line[(f, line)][rank].append(c)
        out: dict[tuple, dict[int, dict]] = defaultdict(dict)
        for (f, line), per_rank in by_line.items():
            use_ep = all(_int(c.get("ep"), None) is not None for recs in per_rank.values() for c in recs)
            for rank, recs in per_rank.items():
                recs.sort(key=lambda c: c["it"])
                if use_ep:
                    for c in recs:
                        slot = out[(f, line, ("epoch", c["ep"]))]
                        if rank not in slot or (c["full"], c["k"]) > (slot[rank]["full"], slot[rank]["k"]):
                            slot[rank] = c
                    continue
                kept = [c for i, c in enumerate(recs) if not (not c["full"] and c["nb"] <= 2 and i < len(recs) - 1)]
                for n, c in enumerate(kept):
                    out[(f, line, ("pass", n))][rank] = c
        return out, raw

    # -- index sets -------------------------------------------------------------------------------
    def _indices(self, ctx: Context, key: tuple, per_rank: dict[int, dict]) -> list:
        recs = {r: c for r, c in per_rank.items() if c.get("kind") == "map" and isinstance(c.get("ix"), str)
                and not c.get("repl")}
        if len(recs) < 2:
            return []
        dists = {r: c.get("dist") for r, c in recs.items()}
        dist = all(isinstance(d, list) and len(d) == 4 for d in dists.values())
        if not dist and (len({c.get("dk") for c in recs.values()}) != 1 or next(iter(recs.values())).get("dk") is None):
            return []  # per-rank datasets (or unknown ones): their indices name different samples
        r0 = min(recs)
        c0 = recs[r0]
        locs = [ctx.loc(r0, c0.get("order"), "order"), ctx.loc(r0, c0.get("site"), "iteration")]
        what = f"the {c0.get('smp') or 'sampler'} of the DataLoader created at {ctx.where(r0, c0.get('created'))}"
        epoch = _label(key[2])
        if (dist and self._explained(ctx, recs)) or (c0.get("sub") and _splits_differ(ctx)):
            return []
        # one representative per shard: ranks given the same DistributedSampler rank share it by design
        # (tensor/pipeline-parallel peers), unless num_replicas is the whole job (rank=local_rank)
        reps: dict[object, int] = {}
        for r in sorted(recs):
            shard = dists[r][1] if dist else (recs[r].get("fp"), recs[r].get("k"))
            reps.setdefault(shard, r)
        if dist and len(reps) < len(recs) and int(dists[r0][0] or 0) == len(ctx.run.ranks) == len(recs):
            groups = by_value({r: d[1] for r, d in dists.items()})
            twins = [rs for rs in groups.values() if len(rs) > 1]
            msg = (f"In {epoch}, {what} is told the same rank on several ranks ({describe(groups, lambda v: f'rank={v}')}) "
                   f"with num_replicas={dists[r0][0]}, the whole job: those ranks draw the same shard and "
                   f"{int(dists[r0][0]) - len(reps)} shard(s) are drawn by no rank (rank=local_rank on several nodes?).")
            return [self.finding(msg, sorted(r for rs in twins for r in rs), locs, kind="overlap",
                                 data={"what": "overlap", "pass": epoch, "sranks": {str(r): d[1] for r, d in dists.items()}})]
        # the DataLoader's own samplers over the dataset itself walk all of it on every rank
        walks_all = not dist and all(c.get("smp") in _WHOLE and not c.get("sub") for c in recs.values())
        if len(reps) == 1 or walks_all:
            return self._whole(ctx, recs, what, epoch, locs, dist)
        rate = max(int(recs[r].get("rate", 0) or 0) for r in reps.values())
        sets = {}
        for r in reps.values():
            ix = decode(recs[r]["ix"])
            if ix is None:
                return []
            sets[r] = at_rate(ix, int(recs[r].get("rate", 0) or 0), rate)
        shared, extra, union, examples = compare(sets)
        ns = {r: c.get("n") for r, c in recs.items()}
        n = ns[r0] if len(set(ns.values())) == 1 and isinstance(ns[r0], int) else None
        full = all(recs[r].get("full") for r in reps.values())
        pad = 0
        if dist and not dists[r0][2] and n is not None:
            pad = max(0, int(dists[r0][3] or 0) - n)  # DistributedSampler repeats this many to even out
        missing = (n - (union << rate)) if (n is not None and full) else None
        counts = (f"{_scale(shared, rate)} sample(s) are drawn by more than one rank"
                  + (f" (e.g. indices {examples})" if examples and not rate else "")
                  + (f" and {missing} by none" if missing and missing > 0 else ""))
        data = {"pass": epoch, "shared": shared << rate, "extra": extra << rate, "union": union << rate,
                "n": n if n is not None else ns, "missing": missing, "sampled": bool(rate)}
        ranks = sorted(reps.values())
        if dist and len(set(ns.values())) > 1:
            groups = by_value(ns)
            msg = (f"{what[0].upper()}{what[1:]} splits datasets of different lengths on different ranks "
                   f"({describe(groups)}) in {epoch}: each rank takes its share of its own index range, so "
                   f"{counts}.")
            return [self.finding(msg, sorted(recs), locs, kind="lengths", data={"what": "lengths", **data})]
        if (extra << rate) > pad:
            locs = _with_shuffle(ctx, r0, c0.get("order"), locs)
            msg = (f"In {epoch} of {what}, the ranks' shards overlap: {counts}"
                   + (f" (padding accounts for at most {pad})" if pad else "") + ". "
                   "The shards are cut from orders that differ across ranks, or from per-rank lists.")
            kind = "overlap" if dist else "sampler-overlap"
            return [self.finding(msg, ranks, locs, kind=kind, data={"what": kind, **data})]
        if dist and missing is not None and len(reps) == int(dists[r0][0] or 0):
            allowed = n % len(reps) if dists[r0][2] else 0
            if missing > allowed:
                msg = (f"In {epoch} of {what}, {missing} of {n} samples are drawn by no rank"
                       + (f" (drop_last accounts for {allowed})" if allowed else "") + ".")
                return [self.finding(msg, ranks, locs, kind="missing", data={"what": "missing", **data})]
        return []

    @staticmethod
    def _explained(ctx: Context, recs: dict[int, dict]) -> bool:
        """The DistributedSampler's own records (seed, epoch, dataset length, Subset indices) already
        differ across ranks: unseeded-rng / sampler-misuse report that root cause."""
        if not (ctx.enabled("DD004") or ctx.enabled("DD007")):
            return False
        seen = {}
        for r, c in recs.items():
            want = site_key(ctx, r, c.get("order"))
            seen[r] = frozenset((s.get("seed"), s.get("epoch"), s.get("n"), s.get("data_fp"))
                                for s in ctx.run.ranks[r].records("sampler")
                                if site_key(ctx, r, s.get("created") if s.get("created") is not None else s.get("site")) == want)
        return len(set(seen.values())) > 1

    def _whole(self, ctx: Context, recs: dict[int, dict], what: str, epoch: str, locs: list, dist: bool) -> list:
        """Every rank drew the same set: the data is not sharded at all."""
        c0 = recs[min(recs)]
        size = max(int(c.get("u", 0) or 0) for c in recs.values())
        if size < 2:
            return []
        ranks = sorted(recs)
        training = any(int(c.get("steps", 0) or 0) > 0 for c in recs.values()) and _ddp_spans(ctx, ranks)
        how = "a DistributedSampler with num_replicas=1" if dist else "no DistributedSampler"
        n = c0.get("n")
        walks_all = all(c.get("smp") in _WHOLE and not c.get("sub") for c in recs.values())
        same = f"the whole dataset ({n} samples)" if isinstance(n, int) and all(
            c.get("n") == n for c in recs.values()) and (size == n or walks_all) else f"the same {size} samples"
        msg = (f"In {epoch} of {what}, every rank ({fmt(ranks)}) draws {same} "
               f"({how})" + (": the DDP model trains on every sample world-size times per epoch, and the "
                             "epoch costs the whole dataset on every rank." if training else
                             ": each rank does the whole work (fine for an evaluation every rank needs)."))
        return [self.finding(msg, ranks, locs, kind="whole", severity=None if training else "info",
                             data={"what": "whole", "samples": size, "training": training})]

    # -- files read while drawing batches ---------------------------------------------------------
    @staticmethod
    def _reads(ctx: Context) -> tuple[dict, dict, dict]:
        """Files read while a DataLoader drew a batch: {(loader file, line, pass): {rank: paths}},
        {(pass key, path): (rank, site) of the first read}, {(loader file, line): every path}."""
        hosts = {rt.header.get("host") for rt in ctx.run.ranks.values()}
        reads: dict[tuple, dict[int, set]] = defaultdict(lambda: defaultdict(set))
        first: dict[tuple, tuple] = {}
        for rank, rt in ctx.run.ranks.items():
            for f in rt.records("file"):
                dl = f.get("dl")
                if f.get("op") != "r" or f.get("probe") or not isinstance(dl, list) or len(dl) != 2 \
                        or _int(dl[1], None) is None or not isinstance(f.get("path"), str):
                    continue
                if f.get("loc") and len(hosts) > 1:
                    continue  # a machine-local path names a different file on each host
                lf, line = site_key(ctx, rank, dl[0])
                k = (lf, line, dl[1])
                reads[k][rank].add(f.get("path"))
                first.setdefault((k, f.get("path")), (rank, f.get("site")))
        every: dict[tuple, set] = defaultdict(set)
        for k, per_rank in reads.items():
            for paths in per_rank.values():
                every[k[:2]].update(paths)
        return reads, first, every

    def _files(self, ctx: Context, k: tuple, covs: dict[int, dict]) -> list:
        reads, first, every = ctx.shared("data-coverage-reads", self._reads)
        per_rank = reads.get(k, {})
        if len(per_rank) < 2 or any(c.get("kind") != "iter" for c in covs.values()):
            return []  # map-style data is sharded by index: the index sets say it
        reps: dict[frozenset, int] = {}
        for r in sorted(per_rank):
            reps.setdefault(frozenset(per_rank[r]), r)
        r0 = min(per_rank)
        loader = covs.get(r0, {}).get("created")
        epoch = _label(("pass", k[2]))
        where = f"the DataLoader created at {ctx.where(r0, loader)}"
        if len(reps) == 1:
            paths = sorted(per_rank[r0])
            if len(paths) < 2:
                return []
            training = _ddp_spans(ctx, per_rank) and any(int(c.get("steps", 0) or 0) for c in covs.values())
            rr, sid = first[(k, paths[0])]
            msg = (f"In {epoch} of {where}, every rank ({fmt(sorted(per_rank))}) reads the same "
                   f"{len(paths)} files ({_names(paths)}): the files are not sharded by rank.")
            return [self.finding(msg, sorted(per_rank), [ctx.loc(rr, sid, "read"), ctx.loc(r0, loader, "loader")],
                                 kind="same-files", severity=None if training else "info",
                                 data={"what": "same-files", "files": len(paths), "training": training})]
        count: dict[str, int] = defaultdict(int)
        for paths in reps:
            for p in paths:
                count[p] += 1
        # only files like the ones that are sharded (same folder and extension as a file one rank
        # alone read): a vocabulary or index file every rank's iterator opens is shared by design
        shard_like = {(os.path.dirname(p), os.path.splitext(p)[1]) for p, c in count.items() if c == 1}
        shared = sorted(p for p, c in count.items()
                        if c > 1 and (os.path.dirname(p), os.path.splitext(p)[1]) in shard_like)
        if not shared:
            return []
        full = all(c.get("full") for c in covs.values()) and set(per_rank) <= set(covs)
        unread = sorted(every[k[:2]] - set(count)) if full else []
        rr, sid = first[(k, shared[0])]
        locs = _with_shuffle(ctx, r0, loader, [ctx.loc(rr, sid, "read"), ctx.loc(r0, loader, "loader")])
        msg = (f"In {epoch} of {where}, {len(shared)} file(s) are read by more than one rank ({_names(shared)})"
               + (f" and {len(unread)} read in another pass by no rank in this one ({_names(unread)})"
                  if unread else "")
               + ": the ranks shard different orders of the file list (a shuffle that differs across "
                 "ranks before files[rank::world]) or per-rank lists.")
        return [self.finding(msg, sorted(reps.values()), locs, kind="file-overlap", data={"what": "file-overlap", "shared": len(shared),
                                                        "unread": len(unread)})]


    def _batches(self, ctx: Context, k: tuple, covs: dict[int, dict]) -> list:
        """Ranks whose IterableDataset pass began with the very same batches (``bfp``: the
        fingerprint of its first ``nbfp`` batches) while one DDP model trained on them. Quiet for
        passes without DDP steps (an evaluation every rank runs over the same data), for ranks
        outside one DDP group (tensor-parallel peers share their data by design), and for
        batches held on an accelerator (not fingerprinted: reading them would synchronise)."""
        groups: dict[tuple, list[int]] = defaultdict(list)
        for r, c in covs.items():
            n = _int(c.get("nbfp"), None)
            if c.get("kind") == "iter" and isinstance(c.get("bfp"), str) and n is not None and n >= 2:
                groups[(c["bfp"], n)].append(r)
        out = []
        for (_, n), ranks in groups.items():
            if len(ranks) < 2 or not _ddp_spans(ctx, ranks):
                continue
            if not any(int(covs[r].get("steps", 0) or 0) for r in ranks):
                continue
            ranks.sort()
            r0 = ranks[0]
            loader = covs[r0].get("created")
            msg = (f"In {_label(('pass', k[2]))} of the DataLoader created at {ctx.where(r0, loader)}, "
                   f"{fmt(ranks)} got the very same first {n} batches from its IterableDataset while a DDP "
                   "model trained on them: the stream is not sharded by rank, so every rank trains on the same "
                   "samples (DDP averages equal gradients: one rank's batch per step, at world-size times the "
                   "cost). If each rank takes its own part of every batch afterwards, this is intended.")
            locs = [ctx.loc(r0, loader, "loader")]
            if covs[r0].get("site") is not None:
                locs.append(ctx.loc(r0, covs[r0].get("site"), "iteration"))
            out.append(self.finding(msg, ranks, locs, kind="same-batches",
                                    data={"what": "same-batches", "batches": n, "training": True}))
        return out


def _with_shuffle(ctx: Context, rank: int, sid, locs: list) -> list:
    """The shuffle that built the order the line ``sid`` shards, first, when the source shows one."""
    s = ctx.site(rank, sid)
    found = order_line(s.get("file"), int(s.get("line", 0) or 0)) if s.get("file") else None
    if found is None:
        return locs
    return [Location(rank, s.get("file", "?"), found[0], "", found[1], "shuffle")] + locs


def _names(paths: list[str]) -> str:
    return ", ".join(os.path.basename(p) for p in paths[:4]) + (", ..." if len(paths) > 4 else "")
