"""BatchNorm layers of a DDP module in train mode on some ranks and eval mode on others at the
same training step (part of batchnorm-sync, DD014).

"The same step" is the same gradient all-reduce: the j-th DDP backward of the module, which every
rank runs together. From the ``bn`` records with ``op`` ``mode`` (rank/patches/bnmode.py), each
carrying the number of backwards the module had run when the modes changed, the mode in effect at
step j on a rank is the last one recorded with ``bwd <= j - 1``. Steps are compared up to the
fewest any rank ran, so evaluation that one rank runs alone after (or between) the training steps,
with no backward, is never compared: rank-0-only evaluation stays quiet. With SyncBatchNorm, whose
forward all-gathers in train mode only, differing modes stop the job inside the next step: when a
rank did not reach a normal exit, that step is compared too.
"""

from __future__ import annotations

from ._records import by_value, minority
from .base import Context, fmt


def _int(v) -> int:
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) < 1 << 53 else 0


def _steps(ctx: Context, rank: int, recs: list[dict], modules: int) -> int | None:
    """Gradient all-reduces this module ran on this rank: from the exit record, else (one DDP
    module) the rank's DDP backwards; None when unknown."""
    ends = [r for r in recs if r.get("at") == "exit"]
    if ends:
        return _int(ends[-1].get("bwd"))
    if modules == 1:
        return _int(ctx.run.ranks[rank].ddp_steps.get("ddp_backward", 0))
    return None


def _mode_at(recs: list[dict], step: int) -> dict | None:
    cur = None
    for r in recs:
        if r.get("at") != "exit" and _int(r.get("bwd")) <= step - 1:
            cur = r
    return cur


def _label(rec: dict) -> str:
    n, of = _int(rec.get("train")), _int(rec.get("of"))
    if n == of:
        return "train mode"
    if n == 0:
        return "eval mode"
    return f"train mode for {n} of {of} layers"


def mode_finding(check, ctx: Context, idx: int, sbn: bool):
    """The first step at which the module's BatchNorm modes differ across ranks, as a finding."""
    per: dict[int, list[dict]] = {}
    for r, rt in ctx.run.ranks.items():
        recs = [x for x in rt.records("bn") if x.get("op") == "mode" and _int(x.get("id")) == idx]
        if recs:
            per[r] = recs
    if len(per) < 2:
        return None
    counts = {r: len(ctx.run.ranks[r].records("ddp")) for r in per}
    steps = [_steps(ctx, r, recs, counts[r]) for r, recs in per.items()]
    if any(s is None for s in steps):
        return None
    last = min(s for s in steps if s is not None)
    if sbn and any(not any(x.get("at") == "exit" for x in recs) for recs in per.values()):
        # SyncBatchNorm's own collectives in forward stop the ranks inside the step after the
        # last complete one when the modes differ: that step counts too
        last += 1
    candidates = sorted({_int(x.get("bwd")) + 1 for recs in per.values() for x in recs})
    for step in (j for j in candidates if 1 <= j <= last):
        modes = {r: _mode_at(recs, step) for r, recs in per.items()}
        if any(m is None for m in modes.values()):
            continue
        groups = by_value({r: str(m.get("fp")) for r, m in modes.items() if m is not None})
        if len(groups) < 2:
            continue
        odd = minority(groups)
        # the line that put the odd ranks (else the others) in their mode
        changed = [r for r in odd if modes[r].get("at") == "train"] or \
                  [r for r in modes if modes[r].get("at") == "train"]
        desc = "; ".join(f"{fmt(rs)}: {_label(modes[rs[0]])}" for rs in groups.values())
        locs = [ctx.loc(r, modes[r].get("site"), "mode") for r in changed[:2]]
        layers = "SyncBatchNorm" if sbn else "BatchNorm"
        msg = (f"At training step {step} (the module's gradient all-reduce number {step}, which every rank "
               f"runs together) the {layers} layers of DDP module {idx} are in different modes ({desc})")
        if changed:
            r = changed[0]
            msg += f"; the mode was last set at {ctx.where(r, modes[r].get('site'))} on rank {r}"
        msg += ". "
        if sbn:
            msg += ("In train mode SyncBatchNorm all-gathers batch statistics across ranks in every forward, "
                    "in eval mode it does not: the ranks' collectives no longer match (a hang or a "
                    "mismatch).")
        else:
            msg += ("In eval mode BatchNorm normalises with its running statistics instead of the batch's and "
                    "does not update them: the ranks compute gradients of different functions that DDP "
                    "averages, and the running statistics advance on some ranks only (with broadcast_buffers, "
                    "rank 0's overwrite the others' at the next forward).")
        return check.finding(msg, odd, locs, kind="mode",
                             evidence=[[fmt(rs), _label(modes[rs[0]]), f"step {step}"] for rs in groups.values()],
                             data={"module": idx, "op": "mode", "step": step,
                                   "modes": {str(r): _label(m) for r, m in modes.items() if m is not None}})
    return None
