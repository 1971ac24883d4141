"""rank-failed: a rank raised, or was killed, while the others were in or heading to a collective.

The root cause is told apart from the collateral failures it causes (see ``_failures``): when
rank 1 raises ValueError and rank 0 then fails with "Connection closed by peer", rank 1 is named
and rank 0's error is described as a consequence. Timeouts on every rank with nothing else are
a hang or a divergence (other checks), never a rank failure.
"""

from __future__ import annotations

import os
from collections import defaultdict

from ..findings import Location
from . import _failures
from ._failures import fmt, short_error
from .base import Check, Context, Divergence


def _call(ctx: Context, r: int, ev: dict | None) -> str:
    if not ev:
        return ""
    s = f" #{ev['s']}" if ev.get("s") else ""
    return f"{ev.get('op')}{s} at {ctx.where(r, ev.get('site'))}"


class RankFailed(Check):
    id = "DD008"
    category = "rank-failed"
    severity = "error"
    title = "A rank failed while the others were in or heading to a collective"
    fix = ("Fix the error of the rank named here, at its line; the other ranks' errors (connection "
           "closed by peer, timeouts) are consequences. To survive a per-rank error, catch it and "
           "agree on the outcome with a collective (all-reduce a failure flag so that every rank "
           "skips or stops together); for crashes, checkpoint and restart with torchrun --max-restarts.")

    def explains(self, ctx: Context, divergence: Divergence) -> bool:
        # The sequence ended because the ranks with no call died of a root cause.
        roots = _failures.root_causes(ctx)
        return (bool(divergence.stopped) and all(r in roots for r in divergence.stopped)
                and len(divergence.by_op) == 2)

    def run(self, ctx: Context):
        ends = _failures.endings(ctx)
        roots = [e for e in ends.values() if e.root]
        if ctx.enabled("DD012"):
            roots = [e for e in roots if not e.misuse]  # collective-misuse explains those
        if not roots:
            return []
        groups: dict[tuple, list] = defaultdict(list)
        for e in roots:
            # same exception type at the same line: one finding, even if the texts name the rank
            key = (e.how, e.exc.split(":", 1)[0], e.file, e.line) if e.how == "exception" else (e.how,)
            groups[key].append(e)
        first_t = min(e.t_end for e in roots)
        findings = []
        for _key, es in sorted(groups.items(), key=lambda kv: min(e.t_end for e in kv[1])):
            rs = sorted(e.rank for e in es)
            others = [o for o in ends.values() if o.rank not in rs]
            if es[0].how == "killed" and not self._affected(ctx, rs, others):
                continue  # e.g. os._exit() at the very end, after every collective: nobody waited
            findings.append(self._finding(ctx, es, others, len(groups) > 1
                                          and min(e.t_end for e in es) == first_t))
        return findings

    @staticmethod
    def _affected(ctx: Context, rs: list[int], others) -> bool:
        """Whether another rank was left waiting: it failed, was in flight, or issued
        collectives the failed ranks never reached."""
        for o in others:
            if o.how != "normal" or o.inflight:
                return True
        for g in ctx.groups:
            counts = [ctx.run.ranks[r].groups[g].count if g in ctx.run.ranks[r].groups else 0
                      for r in ctx.run.group_members(g) if r in ctx.run.ranks]
            mine = [ctx.run.ranks[r].groups[g].count for r in rs if g in ctx.run.ranks[r].groups]
            if counts and mine and min(mine) < max(counts):
                return True
        return False

    def _finding(self, ctx: Context, es: list, others: list, first: bool):
        rs = sorted(e.rank for e in es)
        e = es[0]
        r = e.rank
        rt = ctx.run.ranks[r]
        last = rt.tail[-1] if rt.tail else None
        locs: list[Location] = []
        if e.how == "exception":
            src = ""
            for fr in e.stack:
                if len(fr) >= 4 and fr[0] == e.file and fr[1] == e.line:
                    src = str(fr[3])
            locs.append(Location(r, e.file, e.line, e.func, src, "exception"))
            what = (f"{fmt(rs)} raised {short_error(e.exc, 160)} at "
                    f"{os.path.basename(e.file)}:{e.line} in {e.func}()")
            if len({x.exc for x in es}) > 1:
                what += f" (rank {r}'s text; the others' differ in detail)"
        else:
            what = (f"{fmt(rs)} ended without an exit record (killed: SIGKILL, the OOM killer, a crash "
                    f"or os._exit{'; its trace file is truncated' if e.truncated else ''})")
        if e.inflight:
            inf = e.inflight[0]
            what += f", inside {_call(ctx, r, inf)}"
            locs.append(ctx.loc(r, inf.get("site"), "in flight"))
        elif last is not None:
            what += f", after {'its' if len(rs) == 1 else 'their'} last call {_call(ctx, r, last)}"
            locs.append(ctx.loc(r, last.get("site"), "last call"))
        if first:
            what += " (the first failure)"
        parts: dict[str, list[int]] = defaultdict(list)
        waits: dict[str, tuple] = {}
        for o in others:
            text, ev = self._other(ctx, o)
            parts[text].append(o.rank)
            if ev is not None and text not in waits:
                waits[text] = (o.rank, ev.get("site"))
        msg = what + "."
        if parts:
            msg += " Meanwhile " + "; ".join(
                f"{fmt(ors)} {text.replace('{be}', 'was' if len(ors) == 1 else 'were')}"
                for text, ors in parts.items()) + "."
        collateral = sorted(o.rank for o in others if o.failed and not o.root)
        if collateral:
            one = len(collateral) == 1
            msg += (f" {fmt(collateral).capitalize()}'s failure{' is' if one else 's are'} collateral "
                    f"damage of {fmt(rs)}'s, not a bug of {'its' if one else 'their'} own.")
        elif not others:
            msg += " Every rank failed the same way: the error is not rank-specific."
        for o, sid in list(waits.values())[:4]:
            locs.append(ctx.loc(o, sid, "waiting"))
        evidence = [[fmt(rs), "root cause", short_error(e.exc, 80) if e.exc else "killed"]]
        evidence += [[fmt(ors), "collateral" if ors[0] in collateral else "-",
                      text.replace("{be}", "was" if len(ors) == 1 else "were")]
                     for text, ors in parts.items()]
        return self.finding(msg[:1].upper() + msg[1:], rs, locs, evidence=evidence,
                            data={"culprit": rs, "how": e.how, "exc": e.exc, "file": e.file,
                                  "line": e.line, "collateral": collateral})

    @staticmethod
    def _other(ctx: Context, o) -> tuple[str, dict | None]:
        """One rank's situation when the culprit failed, in words, and the call it waited in."""
        rt = ctx.run.ranks[o.rank]
        ev = o.inflight[0] if o.inflight else None
        if o.how == "exception" and o.comm:
            fe = o.failed_event
            if fe is not None and short_error(str(fe.get("err", "")), 60) == short_error(o.exc, 60):
                ev = fe
            where = f"{{be}} waiting in {_call(ctx, o.rank, ev)} and " if ev else ""
            return f"{where}failed with {short_error(o.exc)} ({o.why})", ev
        if o.how == "exception":
            return f"raised {short_error(o.exc)}", ev
        if ev is not None:
            return f"{{be}} waiting in {_call(ctx, o.rank, ev)}", ev
        last = rt.tail[-1] if rt.tail else None
        after = f" (last call: {_call(ctx, o.rank, last)})" if last is not None else ""
        if o.how == "normal":
            return f"exited normally{after}", None
        if o.how == "hang-kill":
            return f"{{be}} ended by ddpdoctor's hang watchdog{after}", last
        return f"{{be}} ended without an exit record{after}{', ' + o.why if o.why else ''}", last
