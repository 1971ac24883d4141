"""divergent-collectives: the ranks' collective sequences in a group differ."""

from __future__ import annotations

import os
from collections import defaultdict

from ..findings import Location
from . import _failures
from . import collective_misuse as misuse
from . import p2p_mismatch as p2p
from . import uneven_inputs as uneven
from .base import Check, Context, fmt

_DDP_DESC = {"ddp_forward": "a DDP forward (it broadcasts buffers)",
             "ddp_backward": "a DDP backward (it all-reduces gradients)",
             "ddp_init": "DDP construction (it broadcasts parameters)"}


def describe_op(op: str | None, ev: dict | None) -> str:
    if op is None:
        return "no further call"
    base = _DDP_DESC.get(op, op)
    return f"{base} #{ev.get('s')}" if ev and ev.get("s") else base


def culprit(ctx: Context, by_op: dict, point) -> tuple[list[int], str]:
    """Ranks to blame, by comparing ranks: the minority; on a tie, the side whose call sits
    under a rank-dependent condition the others do not pass. Never "rank 0 is right"."""
    sizes = sorted(((len(rs), op) for op, rs in by_op.items()), key=lambda t: (t[0], str(t[1])),
                   reverse=True)
    if len(sizes) >= 2 and sizes[0][0] > sizes[1][0]:
        majority = sizes[0][1]
        return sorted(r for op, rs in by_op.items() if op != majority for r in rs), "minority"
    flagged = []
    for op, rs in by_op.items():
        r = rs[0]
        ev = point.events[r]
        if ev is None:
            continue
        others = [(o, point.events[o].get("site")) for op2, rs2 in by_op.items() if op2 != op
                  for o in rs2[:1] if point.events[o] is not None]
        conds = ctx.split_conditions(r, ev.get("site"), others)
        if any(c.role == "condition" for c in conds):
            flagged.append(op)
    if len(flagged) == 1:
        return sorted(by_op[flagged[0]]), "condition"
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
    from ddpdoctor.trace.sourceinfo import loop_left

    sides = [(op, rs) for op, rs in by_op.items()]
    for op, rs in sides:
        ev = point.events[rs[0]]
        if ev is None:
            continue
        mine = ctx.site(rs[0], ev.get("site")).get("conds") or []
        for op2, rs2 in sides:
            if op2 == op:
                continue
            ev2 = point.events[rs2[0]]
            theirs = ctx.site(rs2[0], ev2.get("site")).get("conds") or [] if ev2 is not None else []
            found = loop_left(mine, theirs)
            if found is None:
                continue
            base = os.path.basename(found["file"])
            text = (f"{fmt(rs2)} left the loop at {base}:{found['line']} `{found['text']}` that "
                    f"{fmt(rs)} {'is' if len(rs) == 1 else 'are'} still in")
            locs = [Location(rs2[0], found["file"], found["line"], "", found["text"], "loop")]
            exits = [e for e in found["exits"] if e[2]]
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
        failed = ctx.failed_ranks()
        roots = _failures.root_causes(ctx) if ctx.enabled("DD008") else set()
        for group, p in ctx.divergences.items():
            if ctx.enabled("DD002") and any(m.seq < p.seq for m in ctx.mismatches.get(group, [])):
                # Ranks that passed different sizes to a collective leave it at different
                # times and drift apart: DD002 reports that root cause.
                continue
            by_op: dict = defaultdict(list)
            for r, ev in sorted(p.events.items()):
                by_op[(ev or {}).get("op")].append(r)
            stopped = by_op.get(None, [])
            if stopped and all(r in roots for r in stopped) and len(by_op) == 2:
                continue  # the sequence ended because the rank died: rank-failed owns it
            if uneven.explains(ctx, group, p):
                continue  # a DDP step against nothing/another op: uneven-inputs explains it
            if stopped and p2p.explains(ctx, stopped):
                continue  # the stopped ranks sit in a mismatched send/recv: p2p-mismatch explains it
            if misuse.explains(ctx, p):
                continue  # a call that failed for want of a process group: collective-misuse
            blame, why = culprit(ctx, by_op, p)
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
                                 f"in this group{', then exited' if all(r in failed or self._exited(ctx, r) for r in rs) else ''})")
                    evidence.append([fmt(rs), "no call", "-"])
                    continue
                sid = ev.get("site")
                others = [(o, p.events[o].get("site")) for op2, rs2 in by_op.items() if op2 != op
                          for o in rs2[:1] if p.events[o] is not None]
                conds = ctx.split_conditions(rs[0], sid, others)
                loc = ctx.loc(rs[0], sid)
                locations.append(loc)
                text = f"{fmt(rs)} call{'s' if len(rs) == 1 else ''} {describe_op(op, ev)} at {ctx.where(rs[0], sid)}"
                if ev.get("pending"):
                    text += " (still waiting in it)"
                for c in conds[:1]:
                    locations.append(c)
                    text += f", reached through {c.short()} `{c.source}`"
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
            findings.append(self.finding(msg, blame or list(p.events), locations, evidence=evidence,
                                         data={"group": group, "seq": p.seq, "culprit": blame,
                                               "ops": {str(k): v for k, v in by_op.items()}}))
        return findings

    @staticmethod
    def _exited(ctx: Context, r: int) -> bool:
        ex = ctx.run.ranks[r].exit_record()
        return ex is not None
