"""collective-misuse: a collective outside the process group's lifetime, and groups that the ranks
created with different member lists."""

from __future__ import annotations

import os
from collections import defaultdict

from ..findings import Location
from . import _failures
from ._failures import fmt
from .base import Check, Context, Divergence, Kind


def explains(ctx: Context, point) -> bool:
    """Whether a divergence is only a call that failed for want of a process group (it took a
    sequence number without communicating): collective-misuse reports it instead."""
    if not ctx.enabled(CollectiveMisuse.id):
        return False
    return any(_failures.is_misuse(str((ev or {}).get("err", ""))) for ev in point.events.values())


def _lifetime(rt) -> tuple[float | None, float | None, object]:
    """(init ts, destroy-of-the-default-group ts, destroy site) of one rank, in its own clock."""
    init = destroy = None
    site = None
    for r in rt.rare:
        t = r.get("t")
        if t == "init" and init is None:
            init = r.get("ts")
        elif t == "pg" and r.get("op") == "destroy" and str(r.get("g", "0")) == "0" and destroy is None:
            destroy, site = r.get("ts"), r.get("site")
    return init, destroy, site


_FIX_LIFETIME = ("Issue every collective between init_process_group() and destroy_process_group() on "
                 "every rank: destroy the group last, after the final barrier/all-reduce.")
_FIX_GROUPS = ("Create each subgroup with new_group(ranks) on ALL ranks, members or not, in the same "
               "order and with the same member list (or use new_subgroups()).")


class CollectiveMisuse(Check):
    id = "DD012"
    category = "collective-misuse"
    severity = "error"
    title = "Collective used outside the process group's lifetime, or groups created inconsistently"
    fix = _FIX_LIFETIME + " " + _FIX_GROUPS
    kinds = {"lifetime": Kind(title="Collective called outside the process group's lifetime", fix=_FIX_LIFETIME),
             "members": Kind(title="Ranks created a process group with different members", fix=_FIX_GROUPS)}

    def explains(self, ctx: Context, divergence: Divergence) -> bool:
        # A call that failed for want of a process group.
        return explains(ctx, divergence.point)

    def run(self, ctx: Context):
        return self._lifetime_errors(ctx) + self._group_members(ctx)

    def _lifetime_errors(self, ctx: Context):
        # (when, op, file, line) -> ranks; one finding per distinct call site, whatever the ranks
        hits: dict[tuple, list[int]] = defaultdict(list)
        detail: dict[tuple, tuple] = {}
        for r, rt in ctx.run.ranks.items():
            init, destroy, dsite = _lifetime(rt)
            seen_sites = set()
            for ev in rt.errors:
                err = str(ev.get("err", ""))
                if not _failures.is_misuse(err):
                    continue
                ts = ev.get("ts") or 0
                when = ("after" if destroy is not None and ts >= destroy else
                        "before" if init is None or ts < init else "outside")
                site = ctx.site(r, ev.get("site"))
                key = (when, str(ev.get("op", "?")), site.get("file", "?"), site.get("line", 0))
                seen_sites.add((key[2], key[3]))
                hits[key].append(r)
                detail.setdefault(key, (r, ev.get("site"), err, dsite))
            # A misuse that raised outside any recorded call (dist.get_rank() after destroy, ...).
            e = _failures.endings(ctx).get(r)
            if e is not None and e.how == "exception" and e.misuse and (e.file, e.line) not in seen_sites:
                ts = rt.exit_record().get("ts") or 0
                when = "after" if destroy is not None and ts >= destroy else "outside"
                key = (when, e.func or "?", e.file, e.line)
                hits[key].append(r)
                detail.setdefault(key, (r, None, e.exc, dsite))
        findings = []
        for key, ranks in sorted(hits.items(), key=lambda kv: kv[1][0]):
            when, op, file, line = key
            r, sid, err, dsite = detail[key]
            where = f"{os.path.basename(str(file))}:{line}"
            locs = []
            if sid is not None:
                locs.append(ctx.loc(r, sid))
                what = f"called {op} at {ctx.where(r, sid)}"
            else:
                locs.append(Location(r, str(file), int(line or 0), str(op), "", "exception"))
                what = f"used torch.distributed at {where} {op}()"
            if when == "after":
                ctx_txt = "after destroy_process_group()"
                if dsite is not None:
                    ctx_txt += f" at {ctx.where(r, dsite)}"
                    dl = ctx.loc(r, dsite)
                    dl.role = "destroy"
                    locs.append(dl)
            elif when == "before":
                ctx_txt = "before init_process_group()"
            else:
                ctx_txt = "without a live process group"
            msg = (f"{fmt(ranks)} {what} {ctx_txt}; it raised "
                   f"{_failures.short_error(err, 160).rstrip('.')}. A collective needs a live process "
                   "group on every rank")
            if len(ranks) < len(ctx.run.ranks):
                msg += "; the ranks that did reach it in time wait for this one and hang or fail"
            msg += "."
            findings.append(self.finding(msg[:1].upper() + msg[1:], ranks, locs, kind="lifetime",
                                         evidence=[[fmt(ranks), f"{op} {ctx_txt}", where]],
                                         data={"kind": "lifetime", "when": when, "op": op}))
        return findings

    def _group_members(self, ctx: Context):
        # group name -> member list -> [ranks that created it so, (rank, site) of one of them]
        seen: dict[str, dict[tuple, list]] = defaultdict(dict)
        for r, rt in ctx.run.ranks.items():
            for rec in rt.records("pg"):
                if rec.get("op") == "destroy" or not isinstance(rec.get("ranks"), list):
                    continue
                members = tuple(int(x) for x in rec["ranks"])
                ent = seen[str(rec.get("g"))].setdefault(members, [[], (r, rec.get("site"))])
                if r not in ent[0]:
                    ent[0].append(r)
        findings = []
        for g, variants in seen.items():
            if len(variants) < 2:
                continue
            parts, locs, evidence = [], [], []
            for members, (ranks, (r, sid)) in sorted(variants.items()):
                shown = list(members[:8]) + (["..."] if len(members) > 8 else [])
                where = f" at {ctx.where(r, sid)}" if sid is not None else ""
                parts.append(f"{fmt(ranks)} created it with members {shown}{where}")
                evidence.append([fmt(ranks), f"members {shown}", where.strip()])
                if sid is not None:
                    locs.append(ctx.loc(r, sid))
            msg = (f"Process group {g} has different member lists on different ranks: "
                   + "; ".join(parts) + ". Groups are matched by creation order, so these ranks think "
                   "they share a group they do not: collectives on it hang, fail, or exchange data "
                   "with the wrong peers.")
            all_ranks = sorted({x for ranks, _ in variants.values() for x in ranks})
            findings.append(self.finding(msg[:1].upper() + msg[1:], all_ranks, locs[:8], evidence=evidence,
                                         kind="members", data={"kind": "members", "group": g}))
        return findings
