"""sync-overhead: barriers that buy nothing, and a straggler rank the others keep waiting for.

Both are judged from measured durations (``d`` of each sequence event, folded by the loader into
per-op and per-call-site totals), with relative AND absolute thresholds so that short or balanced
runs stay silent.
"""

from __future__ import annotations

from collections import defaultdict

from ...trace import ops
from ...trace.ops import BARRIER_OPS
from ._failures import fmt
from .base import Check, Context, Kind

#: A barrier site must run at least this often on every rank to be "one per step".
MIN_REPEATS = 20
#: ... and cost at least this much (seconds, on the rank that spent most in it) ...
MIN_BARRIER_S = 0.1
#: ... and this fraction of the run.
MIN_BARRIER_FRACTION = 0.01
#: A straggler must cost the others this much on average (seconds) ...
MIN_LOST_S = 1.0
#: ... and this fraction of the run, over at least MIN_REPEATS collectives.
MIN_LOST_FRACTION = 0.10
#: Ops whose duration is not waiting for peers (one-off construction).
_NOT_WAITS = ops.CONSTRUCTION
_DDP_STEPS = ops.DDP_STEPS


def _s(us: float) -> str:
    return f"{us / 1e6:.2f} s"


class SyncOverhead(Check):
    id = "DD010"
    category = "sync-overhead"
    severity = "info"
    title = "Needless synchronisation: per-step barriers or a straggler rank"
    fix = ("Remove barriers from the training loop: DDP's gradient all-reduce (and any collective) "
           "already synchronises the ranks. Keep barriers only where one rank must finish something "
           "(writing a file) before the others go on.")
    kinds = {
        "barrier": Kind(title="Barrier on every step (the step synchronises anyway)"),
        "straggler": Kind(
            severity="warning", title="Straggler: the other ranks keep waiting for one rank",
            fix=("Find what the straggler does before its collectives and balance it: more data "
                 "loading workers or faster storage for its shard, logging/evaluation/checkpointing "
                 "outside the step or asynchronous, equal batch sizes, or a healthy machine.")),
    }

    def run(self, ctx: Context):
        duration_us = max(ctx.run.duration_s() * 1e6, 1.0)
        return self._barriers(ctx, duration_us) + self._straggler(ctx, duration_us)

    # -- barriers ---------------------------------------------------------------------------------
    def _barriers(self, ctx: Context, duration_us: float):
        ranks = list(ctx.run.ranks)
        if len(ranks) < 2:
            return []
        # Per barrier call site: count and time on each rank (sites are per rank: match by file:line).
        per_site: dict[tuple, dict[int, list]] = defaultdict(dict)
        for r, rt in ctx.run.ranks.items():
            for (op, sid), (n, total) in rt.op_sites.items():
                if op not in BARRIER_OPS:
                    continue
                s = rt.site(sid)
                key = (op, s.get("file", "?"), s.get("line", 0))
                ent = per_site[key].setdefault(r, [0, 0, sid, 0])
                ent[0] += n
                ent[1] += total
            for (sid, nxt), n in rt.after_barrier.items():
                if nxt in _DDP_STEPS:
                    s = rt.site(sid)
                    for op in BARRIER_OPS:
                        ent = per_site.get((op, s.get("file", "?"), s.get("line", 0)), {}).get(r)
                        if ent is not None:
                            ent[3] += n
        findings = []
        for (op, _file, _line), by_rank in per_site.items():
            if len(by_rank) < len(ranks):
                continue  # not every rank runs it: not a per-step pattern of the whole job
            counts = [v[0] for v in by_rank.values()]
            n = min(counts)
            if n < MIN_REPEATS:
                continue
            times = {r: v[1] for r, v in by_rank.items()}
            worst = max(times.values())
            if worst < MIN_BARRIER_S * 1e6 or worst < MIN_BARRIER_FRACTION * duration_us:
                continue
            reasons = []
            before_ddp = min(v[3] / max(v[0], 1) for v in by_rank.values())
            steps = min(ctx.run.ranks[r].ddp_steps["ddp_backward"] for r in by_rank)
            if steps and 0.5 <= n / steps <= 2:
                reasons.append(f"it runs {n} times for {steps} DDP steps: once per step")
            elif not steps:
                iters = self._loop_partner(ctx, by_rank, n)
                if iters:
                    reasons.append(f"it runs {n} times next to {iters}, which synchronises the ranks "
                                   "anyway")
            if before_ddp >= 0.8:
                reasons.append("it comes right before a DDP forward/backward, which synchronises anyway")
            if not reasons:
                continue
            own = min(times.values())  # what even the last rank to arrive spends: the barrier itself
            r0 = min(by_rank)
            sid = by_rank[r0][2]
            frac = min(worst / duration_us, 1.0)
            severity = "warning" if own >= 0.05 * duration_us and own >= 0.5e6 else "info"
            msg = (f"{op} at {ctx.where(r0, sid)} is needless: " + "; ".join(reasons) + ". "
                   f"The ranks spent {_s(own)} to {_s(worst)} in it ({frac:.0%} of the run at most); "
                   f"{_s(own)} is the barrier's own cost (paid even by the last rank to arrive), the "
                   "rest is waiting for slower ranks, which the next collective would absorb anyway.")
            evidence = [[fmt([r]), f"{by_rank[r][0]} calls", _s(times[r])] for r in sorted(by_rank)[:16]]
            findings.append(self.finding(msg[:1].upper() + msg[1:], sorted(by_rank), [ctx.loc(r0, sid)], severity=severity,
                                         kind="barrier", evidence=evidence,
                                         data={"kind": "barrier", "calls": n, "own_s": own / 1e6,
                                               "max_s": worst / 1e6}))
        return findings

    @staticmethod
    def _loop_partner(ctx: Context, by_rank: dict, n: int) -> str:
        """Without DDP: another collective call site that runs about as often as the barrier
        (the loop's own synchronising work), described; "" if none."""
        best = None
        for r in by_rank:
            rt = ctx.run.ranks[r]
            for (op, sid), (m, _t) in rt.op_sites.items():
                if op in BARRIER_OPS or op in _NOT_WAITS or not 0.5 <= n / max(m, 1) <= 2:
                    continue
                if best is None or m > best[0]:
                    best = (m, op, r, sid)
            break  # rank by rank would only repeat the same sites
        if best is None:
            return ""
        m, op, r, sid = best
        return f"{op} ({m} calls at {ctx.where(r, sid)})"

    # -- straggler --------------------------------------------------------------------------------
    def _straggler(self, ctx: Context, duration_us: float):
        waits: dict[int, float] = {}
        steady: dict[int, float] = {}
        calls: dict[int, int] = {}
        for r, rt in ctx.run.ranks.items():
            total = peaks = 0
            n = 0
            for op, w in rt.waits.items():
                if op in _NOT_WAITS:
                    continue
                total += w[1]
                peaks += w[2] if len(w) > 2 else 0
                n += w[0]
            waits[r], steady[r], calls[r] = total, total - peaks, n
        if len(waits) < 2 or min(calls.values()) < MIN_REPEATS:
            return []
        lo = min(waits.values())
        ordered = sorted(waits.values())
        median = ordered[len(ordered) // 2]
        spread = median - lo
        if spread <= 0:
            return []
        slow = sorted(r for r, w in waits.items() if w - lo <= 0.25 * spread)
        others = [r for r in waits if r not in slow]
        if not others or len(slow) > max(1, (len(waits) - 1) // 2):
            return []  # half the ranks or more wait little: nobody in particular holds the rest back
        lost = sum(waits[o] - lo for o in others) / len(others)
        if lost < MIN_LOST_S * 1e6 or lost < MIN_LOST_FRACTION * duration_us:
            return []
        # Consistently, not once: without each op's single longest wait the gap must remain.
        lo_steady = min(steady[r] for r in slow)
        lost_steady = sum(steady[o] - lo_steady for o in others) / len(others)
        if lost_steady < 0.5 * lost:
            return []
        ops = self._top_ops(ctx, others, slow)
        locs = []
        o = others[0]
        top = max(((k, v) for k, v in ctx.run.ranks[o].op_sites.items() if k[0] not in _NOT_WAITS),
                  key=lambda kv: kv[1][1], default=None)
        if top is not None:
            locs.append(ctx.loc(o, top[0][1], "waiting"))  # where the others lose most time
        msg = (f"{fmt(slow)} {'is' if len(slow) == 1 else 'are'} consistently the last to arrive at "
               f"collectives: over {min(calls.values())} collectives the other ranks "
               f"({fmt(others)}) waited "
               f"{_s(lost)} more each ({lost / duration_us:.0%} of the run) than {fmt(slow)}, mostly in "
               f"{ops}. The time is spent before the collectives (data loading, logging, evaluation or "
               "a slower machine on the straggler); the collectives only make it visible.")
        evidence = [[fmt([r]), f"{calls[r]} collectives", f"waited {_s(waits[r])}"]
                    for r in sorted(waits)[:16]]
        return [self.finding(msg[:1].upper() + msg[1:], slow, locs, kind="straggler", evidence=evidence,
                             data={"kind": "straggler", "lost_s": lost / 1e6, "others": len(others)})]

    @staticmethod
    def _top_ops(ctx: Context, others: list[int], slow: list[int]) -> str:
        excess: dict[str, float] = defaultdict(float)
        for o in others:
            for op, w in ctx.run.ranks[o].waits.items():
                if op not in _NOT_WAITS:
                    excess[op] += w[1]
        for s in slow:
            for op, w in ctx.run.ranks[s].waits.items():
                if op in excess:
                    excess[op] -= w[1] * len(others) / len(slow)
        top = sorted(excess.items(), key=lambda kv: -kv[1])[:2]
        return " and ".join(op for op, v in top if v > 0) or "collectives"
