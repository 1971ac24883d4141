"""uneven-inputs: ranks ran different numbers of DDP steps (the hang at the end of an epoch)."""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field

from ddpdoctor.trace.ranges import fmt_ranks

from ...trace import ops
from ...trace.sourceinfo import loop_exits
from ...verdict import rankdep
from ..findings import Location
from . import _failures
from ._failures import fmt
from ._records import site_key
from .base import Check, Context, Divergence

_STEP_OPS = ops.DDP_STEPS


@dataclass
class Steps:
    """One rank's DDP steps: communicating forwards, backwards (gradient all-reduces) and
    training forwards (grad enabled), each counting a call still in flight at the end."""

    fwd: int
    bwd: int
    train: int
    bwd_open: bool  # its last backward never finished
    site: object

    @property
    def n(self) -> int:
        return max(self.bwd, self.train)


@dataclass
class Uneven:
    groups: frozenset
    steps: dict[int, Steps]
    long: list[int]
    short: list[int]
    owned_by_divergence: bool = False  # a rank-dependent branch explains it: DD001's case
    points: dict = field(default_factory=dict)  # group -> align.Point


def rank_steps(ctx: Context, r: int) -> Steps:
    rt = ctx.run.ranks[r]
    open_ops = [i for i in _failures.in_flight(ctx, r) if i["op"] in _STEP_OPS and i["s"]]
    open_bwd = sum(1 for i in open_ops if i["op"] == "ddp_backward")
    open_fwd = sum(1 for i in open_ops if i["op"] == "ddp_forward")
    fwd = rt.ddp_steps["ddp_forward"] - rt.ddp_local["ddp_forward"] + open_fwd
    bwd = rt.ddp_steps["ddp_backward"] - rt.ddp_local["ddp_backward"] + open_bwd
    site = rt.ddp_sites.get("ddp_backward", rt.ddp_sites.get("ddp_forward"))
    if open_ops:
        site = open_ops[-1].get("site", site)
    return Steps(fwd=fwd, bwd=bwd, train=rt.ddp_train_fwd, bwd_open=bool(open_bwd), site=site)


def analyse(ctx: Context) -> list[Uneven]:
    """See _compute_uneven; computed once per context."""
    return ctx.shared("analyse:uneven_inputs", _compute_uneven)


def _compute_uneven(ctx: Context) -> list[Uneven]:
    """Clusters of ranks training the same DDP groups whose step counts differ (cached)."""
    clusters: dict[frozenset, list[int]] = defaultdict(list)
    for r, rt in ctx.run.ranks.items():
        gs = frozenset(str(d.get("g", "0")) for d in rt.records("ddp"))
        if gs:
            clusters[gs].append(r)
    ends = _failures.endings(ctx)
    out: list[Uneven] = []
    for gs, ranks in clusters.items():
        if len(ranks) < 2:
            continue
        steps = {r: rank_steps(ctx, r) for r in ranks}
        if len({(s.bwd, s.fwd) for s in steps.values()}) == 1:
            # Equal all-reduces; a training forward more on a rank that did not end cleanly is
            # a step it started and never finished (killed before its backward was recorded).
            trains = {s.train for s in steps.values()}
            top, low = max(trains), min(trains)
            if len(trains) == 1 or all(ends[r].how == "normal" for r in ranks if steps[r].train == top):
                continue
            if not all(_moved_on(ends[r]) for r in ranks if steps[r].train == low):
                continue  # every rank was cut off mid-step (job killed): one step apart is a snapshot
            key = {r: s.train for r, s in steps.items()}
        else:
            key = {r: (s.bwd, s.fwd) for r, s in steps.items()}
        hi = max(key.values())
        lo = min(key.values())
        long = sorted(r for r in ranks if key[r] == hi)
        short = sorted(r for r in ranks if key[r] == lo)
        if any(ends[r].root for r in short):
            continue  # the short ranks died: rank-failed explains it
        u = Uneven(groups=gs, steps=steps, long=long, short=short)
        for g in sorted(gs):
            p = ctx.divergences.get(g)
            if p is None:
                continue
            u.points[g] = p
            if _rank_condition(ctx, p):
                u.owned_by_divergence = True
        out.append(u)
    return out


def _moved_on(e) -> bool:
    """Whether a rank had left its training loop: it exited normally, or it was in (or failed
    in) a call that is not a DDP step."""
    if e.how == "normal":
        return True
    last = e.inflight[0] if e.inflight else e.failed_event
    return last is not None and last.get("op") not in _STEP_OPS


def _rank_condition(ctx: Context, p) -> bool:
    """Whether one side's call at the divergence sits under a rank-dependent condition the other
    side's does not (``if rank == 0: model(x)``): a rank-divergent branch, not uneven data."""
    by_op: dict = defaultdict(list)
    for r, ev in p.events.items():
        if ev is not None:
            by_op[ev.get("op")].append(r)
    for op, rs in by_op.items():
        others = [(o, p.events[o].get("site")) for op2, rs2 in by_op.items() if op2 != op
                  for o in rs2[:1]]
        conds = ctx.split_conditions(rs[0], p.events[rs[0]].get("site"), others)
        # A `for` over per-rank data is uneven inputs itself (its trip count differs), not a branch
        if any(c.role == "condition" and not c.source.lstrip().startswith(("for ", "async for "))
               for c in conds):
            return True
    return False


def explains(ctx: Context, group: str, point) -> bool:
    """Whether uneven-inputs reports the divergence at ``point`` (so divergent-collectives need
    not): DDP step counts differ in this group, a DDP step is one side of the divergence, and no
    rank-dependent branch is involved."""
    if not ctx.enabled(UnevenInputs.id):
        return False
    for u in analyse(ctx):
        if group in u.groups and not u.owned_by_divergence and any(
                (ev or {}).get("op") in _STEP_OPS for ev in point.events.values()):
            return True
    return False


def _loop_header(ctx: Context, r: int, sid) -> Location | None:
    for c in ctx.site(r, sid).get("conds") or []:
        if len(c) >= 4 and c[3] in ("for", "while"):
            return Location(r, c[0], int(c[1]), "", c[2], "loop")
    return None


class UnevenInputs(Check):
    id = "DD006"
    category = "uneven-inputs"
    severity = "error"
    title = "Ranks ran different numbers of DDP steps (uneven inputs)"
    fix = ("Give every rank the same number of batches: shard with DistributedSampler (it pads to a "
           "multiple of the world size) or use drop_last=True, cut an IterableDataset to a common "
           "length, or wrap the loop in `with torch.distributed.algorithms.Join([model]):` so that "
           "ranks that run out of data shadow the others' all-reduces. Never skip a step (`continue`, "
           "`break`) on one rank only.")

    def explains(self, ctx: Context, divergence: Divergence) -> bool:
        # A DDP step against nothing or another op.
        return explains(ctx, divergence.group, divergence.point)

    def run(self, ctx: Context):
        findings = []
        ends = _failures.endings(ctx)
        for u in analyse(ctx):
            if u.owned_by_divergence:
                continue
            findings.append(self._finding(ctx, u, ends))
        return findings

    def _finding(self, ctx: Context, u: Uneven, ends):
        by_count: dict[tuple, list[int]] = defaultdict(list)
        for r, s in sorted(u.steps.items()):
            by_count[(s.n, s.bwd, s.bwd_open)].append(r)
        counts = "; ".join(
            f"{fmt(rs)}: {n} step{'s' if n != 1 else ''}" + (" (the last one still waiting in its gradient "
                                                            "all-reduce)" if is_open else "")
            for (n, _b, is_open), rs in sorted(by_count.items(), key=lambda kv: -kv[0][0]))
        r0 = u.long[0]
        sid = u.steps[r0].site
        where = ctx.where(r0, sid)
        locations = [ctx.loc(r0, sid)]
        loop = _loop_header(ctx, r0, sid)
        if loop is not None:
            locations.append(loop)
        exits_note = self._exits(u, ends, loop, locations)
        short_desc = self._short_side(ctx, u, ends, locations)
        hi = max(s.n for s in u.steps.values())
        msg = (f"The ranks ran different numbers of DDP training steps (the step at {where}): "
               f"{counts}. Every step's backward all-reduces gradients across all ranks, so "
               f"{fmt(u.long)} waited in step {hi} for peers that had left the loop")
        msg += f" ({short_desc})." if short_desc else "."
        msg += (" This is the classic hang at the end of an epoch: the ranks got different numbers of "
                "batches (data split by hand, an IterableDataset, a sampler without padding) or one "
                "rank skipped or broke out of a step.")
        msg += exits_note
        hint = self._sampler_hint(ctx, u)
        if hint:
            msg += " " + hint
        evidence = [[fmt(rs), f"{n} steps ({b} gradient all-reduces{', last unfinished' if o else ''})",
                     self._ending(ends[rs[0]])] for (n, b, o), rs in by_count.items()]
        return self.finding(msg[:1].upper() + msg[1:], u.long, locations, evidence=evidence,
                            data={"groups": sorted(u.groups), "long": u.long, "short": u.short,
                                  "steps": {str(r): s.n for r, s in u.steps.items()}})

    @staticmethod
    def _exits(u: Uneven, ends, loop: Location | None, locations: list) -> str:
        """The loop's conditional exits (``if ...: break``), named when ranks with fewer steps left
        it normally: the usual cause is a condition on a per-rank value (early stopping on the
        rank's own loss or metric). Which exit a rank took is not recorded, so all are listed."""
        if loop is None:
            return ""
        left = [r for r in u.short if ends[r].how == "normal"]
        exits = [e for e in loop_exits(loop.file, loop.line) if e[2]][:3] if left else []
        if not exits:
            return ""
        base = os.path.basename(loop.file)
        # the static analysis of the source: a condition on the rank or on this rank's own data
        # (a local validation loss) is the likely exit; named first, with why
        judged = [(e, rankdep.judge(loop.file, e[2], e[3])) for e in exits]
        judged.sort(key=lambda ej: ej[1].state != "yes")
        exits = [e for e, _j in judged]
        listed = "; ".join(f"{base}:{e[0]} `{e[1]}` under {base}:{e[2]} `{e[3]}`"
                           + (f", which {j.reason}" if j.state == "yes" and j.reason else "")
                           for e, j in judged)
        for e in exits:
            locations.append(Location(left[0], loop.file, e[2], "", e[3], "condition"))
            locations.append(Location(left[0], loop.file, e[0], "", e[1], "exit"))
        return (f" The loop at {base}:{loop.line} has conditional exits ({listed}): if {fmt(left)} took "
                "one, its condition was met there first. A condition on a value each rank computes "
                "alone (its own loss or validation metric, a count of its own batches) is met at "
                "different steps on different ranks: decide on a value all-reduced or broadcast "
                "from one rank, so that every rank leaves at the same step.")

    @staticmethod
    def _ending(e) -> str:
        if e.how == "normal":
            return "exited normally"
        if e.how == "exception":
            return "raised " + e.exc.split("\n", 1)[0][:80]
        if e.how == "hang-kill":
            return "ended by ddpdoctor after the hang"
        return "ended without an exit record"

    def _short_side(self, ctx: Context, u: Uneven, ends, locations: list) -> str:
        """What the ranks with fewer steps did instead (their call at the divergence, or how
        they ended)."""
        parts: dict[str, list[int]] = defaultdict(list)
        for r in u.short:
            text = ""
            for p in u.points.values():
                ev = p.events.get(r)
                if ev is not None and ev.get("op") not in _STEP_OPS:
                    sid = ev.get("site")
                    text = f"called {ev.get('op')} #{p.seq} at {ctx.where(r, sid)} instead"
                    if len(locations) < 6:
                        locations.append(ctx.loc(r, sid))
                    break
            if not text:
                text = self._ending(ends[r])
            parts[text].append(r)
        return "; ".join(f"{fmt(rs)} {text}" for text, rs in parts.items())

    @staticmethod
    def _sampler_hint(ctx: Context, u: Uneven) -> str:
        """Samples per rank of each DistributedSampler, matched across ranks by the line that
        created it (a training and a validation sampler are not compared with each other)."""
        per: dict[tuple, dict[int, int]] = defaultdict(dict)
        for r in u.steps:
            for rec in ctx.run.ranks[r].records("sampler"):
                key = site_key(ctx, r, rec.get("created")) if rec.get("created") is not None else ("?", 0)
                per[key][r] = int(rec.get("num_samples", 0) or 0)  # the last epoch's count wins
        if not per:
            return ""
        uneven = {k: v for k, v in per.items() if len(set(v.values())) > 1}
        if uneven:
            (f, line), lens = next(iter(uneven.items()))
            where = f" created at {os.path.basename(f)}:{line}" if line else ""
            return f"(Samples per rank from the DistributedSampler{where}: " + ", ".join(
                f"rank {fmt_ranks([r])}: {n}" for r, n in sorted(lens.items())[:8]) + ".)"
        if all(len(v) == len(u.steps) for v in per.values()):
            return ("(Their DistributedSampler gives every rank the same number of samples, so the "
                    "difference comes from elsewhere: another data source, a skipped step or a break.)")
        return ""

