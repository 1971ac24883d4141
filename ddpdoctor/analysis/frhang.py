"""A collective that never completed, seen in Flight Recorder dumps: who is missing from it.

FR dumps carry no watchdog diagnosis, but each entry says whether its collective completed. The
oldest unfinished collective of a group is where the ranks stuck: the members that issued it
wait; the members whose dump ends before it are behind (divergent-collectives compares those);
the members that left no dump at all cannot be compared, and are the prime suspects when all
the others wait in the same call (a dead, frozen or unreachable rank). Findings go out under the
``hang`` category (DD009).
"""

from __future__ import annotations

from collections import defaultdict

from ..trace.ranges import fmt_ranks
from .findings import Finding


def _where(ctx, r: int, sid) -> str:
    return ctx.where(r, sid)


def findings(check, ctx) -> list[Finding]:
    """FR-specific hang findings for ``check`` (the DD009 check instance)."""
    from . import frmodel

    run = ctx.run
    if not frmodel.is_fr(run):
        return []
    out: list[Finding] = []
    stuck_by_group: dict[str, dict[int, list]] = defaultdict(dict)
    for r, rt in run.ranks.items():
        for g, st in ((rt.header.get("fr") or {}).get("stuck") or {}).items():
            if isinstance(st, list) and len(st) >= 3:
                stuck_by_group[str(g)][r] = st
    for g, stuck in sorted(stuck_by_group.items()):
        members = run.group_members(g)
        no_dump = [r for r in members if r not in run.ranks]
        if not no_dump:
            continue  # every member's dump is here: divergent-collectives / mismatch compare them
        seq = min(st[0] for st in stuck.values())
        waiting = sorted(r for r, st in stuck.items() if st[0] == seq)
        present = [r for r in members if r in run.ranks]
        if set(waiting) != set(present):
            continue  # some dumped ranks are elsewhere: the divergence check explains it
        ops = {stuck[r][1] for r in waiting}
        r0 = waiting[0]
        sid = stuck[r0][2]
        op = "/".join(sorted(ops))
        where = _where(ctx, r0, sid)
        msg = (f"{op} #{seq} in process group {g} never completed: "
               f"rank{'s' if len(waiting) > 1 else ''} {fmt_ranks(waiting)} issued it at {where} and "
               f"{'wait' if len(waiting) > 1 else 'waits'} in it; rank{'s' if len(no_dump) > 1 else ''} "
               f"{fmt_ranks(no_dump)} left no Flight Recorder dump, so {'they' if len(no_dump) > 1 else 'it'} "
               f"never joined it as far as the dumps show: dead, frozen, or stuck before this call "
               f"(its own position is unknown without its dump). Culprit: rank{'s' if len(no_dump) > 1 else ''} "
               f"{fmt_ranks(no_dump)}.")
        locs = [ctx.loc(r0, sid, role="wait")]
        evidence = [[fmt_ranks(waiting), f"waiting in {op} #{seq}", where],
                    [fmt_ranks(no_dump), "no dump", "-"]]
        out.append(check.finding(
            msg, no_dump, locs, title="A collective never completed: ranks missing from it (Flight Recorder)",
            fix=("Find out what happened to the missing ranks (their logs, exit status, the node); if "
                 "they are alive, dump their Flight Recorder too and report all dumps together."),
            evidence=evidence, data={"group": g, "seq": seq, "op": op, "waiting": waiting,
                                     "missing": no_dump, "culprit": no_dump}))
    return out
