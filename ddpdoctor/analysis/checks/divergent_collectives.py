"""divergent-collectives: the ranks' collective sequences in a group differ."""

from __future__ import annotations

import os
from collections import defaultdict

from ...trace import ops
from ...verdict import blame, rankdep
from ..findings import Location
from ._parted import parted_before, previous_sites
from .base import Check, Context, Divergence, fmt


def describe_op(op: str | None, ev: dict | None) -> str:
    if op is None:
        return "no further call"
    base = ops.describe(op)
    return f"{base} #{ev.get('s')}" if ev and ev.get("s") else base


def _side_sites(ctx: Context, by_op: dict, point) -> dict:
    """Per side, the site record of its first rank's call (None for ranks with no call)."""
    out = {}
    for op, rs in by_op.items():
        ev = point.events[rs[0]]
        out[op] = ctx.site(rs[0], ev.get("site")) if ev is not None else None
    return out


def _why(file: str, line: int, text: str) -> str:
    """What makes a condition rank-dependent, when the analysis says (`` (it depends on ...)``)."""
    j = rankdep.judge(file, line, text)
    return f" ({j.reason})" if j.state == "yes" and j.reason else ""


def culprit(ctx: Context, by_op: dict, point, prev: dict | None = None) -> tuple[list[int], str]:
    """Ranks to blame, by comparing ranks (see ``verdict.blame``): the minority; on a tie, the
    side whose call sits under a rank-dependent condition the others do not pass (``prev``: rank
    -> the site of its previous call)."""
    found = blame.minority(by_op)
    if found is not None:
        return found[1], "minority"
    prev = prev or {}
    flagged = blame.conditioned_side(_side_sites(ctx, by_op, point),
                                     {op: prev.get(rs[0]) for op, rs in by_op.items()})
    if flagged is not None:
        return sorted(by_op[flagged]), "condition"
    return [], "tie"


def common_caller(ctx: Context, pairs: list[tuple[int, object]]) -> str | None:
    stacks = []
    for r, sid in pairs:
        st = ctx.site(r, sid).get("stack") or []
        stacks.append([tuple(f[:3]) for f in reversed(st)])
    if not stacks:
        return None
    common = None
    for frames in zip(*stacks):
        if all(f[:2] == frames[0][:2] for f in frames):
            common = frames[0]
        else:
            break
    if common is None:
        return None
    return f"{os.path.basename(common[0])}:{common[1]} {common[2]}()"


def loop_split(ctx: Context, by_op: dict, point) -> dict | None:
    """Two sides where one is still inside a loop the other has left: name the loop and its
    early exits (``break``/``return`` under a condition), and blame the side that left when
    the loop has such exits (a decision on a rank-local value); with none, the loop simply ran
    a different number of times (different data lengths) and nobody is blamed."""
    for op, op2, found, exits in blame.left_loops(_side_sites(ctx, by_op, point)):
        rs, rs2 = by_op[op], by_op[op2]
        base = os.path.basename(found["file"])
        text = (f"{fmt(rs2)} left the loop at {base}:{found['line']} `{found['text']}` that "
                f"{fmt(rs)} {'is' if len(rs) == 1 else 'are'} still in")
        locs = [Location(rs2[0], found["file"], found["line"], "", found["text"], "loop")]
        if exits:
            e = exits[0]
            text += (f"; the loop exits early at {base}:{e[0]} `{e[1]}` under {base}:{e[2]} `{e[3]}`: "
                     "a condition on a rank-local value lets ranks leave it at different iterations.")
            locs.append(Location(rs2[0], found["file"], e[2], "", e[3], "condition"))
            locs.append(Location(rs2[0], found["file"], e[0], "", e[1], "exit"))
            return {"culprit": sorted(rs2), "text": text, "locations": locs}
        text += ": the ranks ran it a different number of times (different data lengths?)."
        return {"culprit": [], "text": text, "locations": locs}
    return None


#: The culprit ran a DDP forward that communicates (rank-0-only evaluation through the DDP model).
_DDP_FORWARD_FIX = (
    "A DDP forward communicates (it broadcasts buffers such as BatchNorm's running stats, and may "
    "prepare the backward's reduction): run it on every rank, or, to evaluate on one rank, call the "
    "wrapped module (`model.module(x)`), which issues no collective.")


class DivergentCollectives(Check):
    id = "DD001"
    category = "divergent-collectives"
    severity = "error"
    title = "Ranks issue different collectives (rank-divergent branch)"
    fix = ("Make every rank of the group issue the same collectives in the same order: move the "
           "collective out of the rank-dependent branch (compute on all ranks, use the result on "
           "one), or give the other ranks a matching call.")

    def run(self, ctx: Context):
        findings = []
        for group, p in ctx.divergences.items():
            by_op: dict = defaultdict(list)
            for r, ev in sorted(p.events.items()):
                by_op[(ev or {}).get("op")].append(r)
            div = Divergence(group, p, by_op, by_op.get(None, []))
            prev = previous_sites(ctx, group, p)
            blame, why = culprit(ctx, by_op, p, prev)
            parted = parted_before(ctx, group, p) if why != "condition" else None
            if parted is None and any(c.explains(ctx, div) for c in ctx.checks if c.id != self.id):
                continue  # another check reports the root cause (mismatch, rank failure, uneven inputs...)
            if parted is not None:
                findings.append(self._parted(ctx, group, p, by_op, parted))
                continue
            loop = loop_split(ctx, by_op, p) if not blame else None
            if loop is not None and loop["culprit"]:
                blame, why = loop["culprit"], "loop"
            locations: list[Location] = []
            parts = []
            evidence = []
            for op, rs in sorted(by_op.items(), key=lambda kv: (kv[0] is None, kv[1])):
                ev = p.events[rs[0]]
                if ev is None:
                    n = {p.counts.get(r, 0) for r in rs}
                    parts.append(f"{fmt(rs)} made no call #{p.seq} (they issued {'/'.join(map(str, sorted(n)))} "
                                 "in this group, then exited)")
                    evidence.append([fmt(rs), "no call", "-"])
                    continue
                sid = ev.get("site")
                others = [(o, p.events[o].get("site")) for op2, rs2 in by_op.items() if op2 != op
                          for o in rs2[:1] if p.events[o] is not None]
                conds = ctx.split_conditions(rs[0], sid, others, [prev.get(o) for o, _ in others])
                loc = ctx.loc(rs[0], sid)
                locations.append(loc)
                text = f"{fmt(rs)} call{'s' if len(rs) == 1 else ''} {describe_op(op, ev)} at {ctx.where(rs[0], sid)}"
                if ev.get("pending"):
                    text += " (still waiting in it)"
                for c in conds[:1]:
                    locations.append(c)
                    text += f", reached through {c.short()} `{c.source}`" + _why(c.file, c.line, c.source)
                parts.append(text)
                evidence.append([fmt(rs), describe_op(op, ev), ctx.where(rs[0], sid)])
            caller = common_caller(ctx, [(rs[0], p.events[rs[0]].get("site")) for op, rs in by_op.items()
                                          if p.events[rs[0]] is not None])
            msg = f"In process group {group}, at collective #{p.seq} the ranks disagree: " + "; ".join(parts) + "."
            if caller:
                msg += f" Common caller: {caller}."
            if loop is not None:
                msg += " " + loop["text"]
                locations.extend(loop["locations"])
            if blame:
                reason = {"minority": "the minority", "condition": "its call is under a rank-dependent condition",
                          "loop": "it left the loop early"}[why]
                msg += f" Culprit: {fmt(blame)} ({reason})."
            msg += " Such a program hangs until the backend's timeout or exchanges wrong data."
            blamed_ops = {op for op, rs in by_op.items() if set(rs) & set(blame or ())}
            findings.append(self.finding(msg, blame or list(p.events), locations, evidence=evidence,
                                         fix=_DDP_FORWARD_FIX if "ddp_forward" in blamed_ops else None,
                                         data={"group": group, "seq": p.seq, "culprit": blame,
                                               "ops": {str(k): v for k, v in by_op.items()}}))
        return findings

    def _parted(self, ctx: Context, group: str, p, by_op: dict, parted: dict):
        """The ranks matched the same op from different call sites, one under a rank-dependent
        branch (a user's barrier paired with a framework's), and diverged later."""
        s = parted["seq"]
        op = next(iter(parted["events"].values())).get("op")
        locations: list[Location] = []
        parts = []
        evidence = []
        for key, rs in sorted(parted["sides"].items(), key=lambda kv: kv[0] != parted["flagged"]):
            ev = parted["events"][rs[0]]
            sid = ev.get("site")
            text = f"{fmt(rs)} call{'s' if len(rs) == 1 else ''} it at {ctx.where(rs[0], sid)}"
            locations.append(ctx.loc(rs[0], sid))
            b = parted["branch"] if key == parted["flagged"] else None
            if b is not None:
                text += f", reached through {os.path.basename(b.file)}:{b.line} `{b.text}`" + \
                    _why(b.file, b.line, b.text)
                locations.append(Location(rs[0], b.file, b.line, "", b.text, "condition"))
            parts.append(text)
            evidence.append([fmt(rs), describe_op(op, ev), ctx.where(rs[0], sid)])
        later = "; ".join(f"{fmt(rs)}: {describe_op(o, p.events[rs[0]])}" for o, rs in sorted(
            by_op.items(), key=lambda kv: (kv[0] is None, kv[1])))
        blame = parted["culprit"]
        msg = (f"In process group {group}, the ranks parted at collective #{s} ({describe_op(op, None)} on every "
               f"rank, but from different call sites): " + "; ".join(parts) + ". The calls paired up, so the "
               f"sequences only disagree later, at collective #{p.seq} ({later}). Culprit: {fmt(blame)} (its "
               "call is under a rank-dependent condition; the others' matching call is another one, e.g. "
               "a framework's own). Such a program hangs until the backend's timeout or exchanges wrong data.")
        for rs in by_op.values():
            ev = p.events[rs[0]]
            if ev is not None:
                locations.append(ctx.loc(rs[0], ev.get("site"), "diverged"))
        return self.finding(msg, blame, locations, evidence=evidence,
                            data={"group": group, "seq": s, "diverged_at": p.seq, "culprit": blame,
                                  "ops": {str(k): v for k, v in by_op.items()}})
