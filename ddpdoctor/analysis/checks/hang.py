"""hang: a collective that waited longer than the hang timeout (from the in-rank watchdog).

The watchdog writes its diagnosis into the reporting rank's trace (a ``hang`` record with
``role: reporter``) and every rank's own position (``role: member``); a hang that later
completed gets a ``role: resolved`` record. Offline, the diagnosis is rebuilt from those records
even when the reporter's own record is missing (its rank was killed first).
"""

from __future__ import annotations

from collections import defaultdict

from ddpdoctor.verdict import hang as hangdiag

from ..findings import Location
from .base import Check, Context, Kind, fmt


class Hang(Check):
    id = "DD009"
    category = "hang"
    severity = "error"
    title = "A collective waited longer than the hang timeout"
    fix = ("Look at the culprit's line: make every rank reach the same collective (no rank-dependent "
           "branch around it, same number of steps), or raise the hang timeout if the wait is "
           "legitimately long (e.g. rank 0 alone writing a large checkpoint).")
    kinds = {"resolved": Kind(
        severity="warning", title="Slow rank: a collective waited past the hang timeout, then completed",
        fix="If this wait is expected (rank 0 writing a checkpoint, a slow data load), raise "
            "--hang-timeout; otherwise balance the work so ranks arrive together.")}

    def run(self, ctx: Context):
        reporters: dict[int, tuple[int, dict]] = {}
        members: dict[int, dict[int, dict]] = defaultdict(dict)
        resolved: dict[int, float] = {}
        local: list[tuple[int, dict]] = []
        for r, rt in ctx.run.ranks.items():
            for rec in rt.records("hang"):
                role, ep = rec.get("role"), int(rec.get("ep", 0) or 0)
                if role == "reporter" and isinstance(rec.get("diag"), dict):
                    reporters[ep] = (r, rec)
                elif role == "member" and isinstance(rec.get("status"), dict):
                    members[ep][r] = rec["status"]
                elif role == "resolved":
                    resolved[ep] = float(rec.get("waited_s", 0) or 0)
                elif role == "local" and isinstance(rec.get("diag"), dict):
                    local.append((r, rec))
        findings = []
        for ep in sorted(set(reporters) | set(members)):
            if ep in reporters:
                rep, rec = reporters[ep]
                diag = rec["diag"]
            else:  # rebuild: every member's position, reporter unknown -> the longest waiter
                statuses = members[ep]
                waiting = [r for r, s in statuses.items() if s.get("state") == "collective"]
                if not waiting:
                    continue
                rep = max(waiting, key=lambda r: float(statuses[r].get("since_s", 0) or 0))
                diag = hangdiag.diagnose(statuses, ctx.run.world, 0.0, rep)
            findings.append(self._finding(ctx, ep, diag, resolved.get(ep)))
        for _r, rec in local:
            findings.append(self._finding(ctx, 0, rec["diag"], None))
        from .. import frhang

        findings.extend(frhang.findings(self, ctx))  # Flight Recorder input: no watchdog records
        return findings

    def _finding(self, ctx: Context, ep: int, diag: dict, resolved_after: float | None):
        culprit = [int(c) for c in diag.get("culprit") or []]
        rows = diag.get("rows") or []
        locs = [Location(int(d.get("rank", 0)), str(d.get("file")), int(d.get("line") or 0),
                         str(d.get("function", "")), str(d.get("source", "")), str(d.get("role", "wait")))
                for d in diag.get("locations") or []]
        cond = diag.get("condition")
        if cond:
            locs.append(Location(int(cond["rank"]), str(cond["file"]), int(cond["line"]), "",
                                 str(cond["text"]), "condition"))
        table = "; ".join(f"{r[0]}: {r[1]} {r[2]} at {r[3]}" for r in rows)
        head = (f"Collective #{diag.get('seq')} ({diag.get('op')}) in process group {diag.get('group')} "
                f"waited {diag.get('waited_s', 0)} s (verdict: {diag.get('verdict')}). Ranks: {table}.")
        if culprit:
            head += f" Culprit: {fmt(culprit)} — {diag.get('reason')}."
        else:
            head += f" No single culprit: {diag.get('reason')}."
        if cond:
            head += f" Rank {cond['rank']} got there through {cond['file']}:{cond['line']} `{cond['text']}`."
        if resolved_after is not None:
            return self.finding(
                head + f" It then completed after {resolved_after:.1f} s: a slow rank, not a hang.",
                culprit or [int(diag.get("reporter", 0))], locs, kind="resolved", evidence=rows, data={"episode": ep, "diagnosis": diag, "resolved_after_s": resolved_after})
        return self.finding(head, culprit or [int(diag.get("reporter", 0))], locs, evidence=rows,
                            data={"episode": ep, "diagnosis": diag})

