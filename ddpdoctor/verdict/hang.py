"""The hang diagnosis: from every rank's position to a verdict, a culprit and a table.

Pure functions over plain dicts, shared by the live watchdog (statuses gathered through the
c10d store) and the offline report (statuses rebuilt from trace files). The culprit is found
by comparing ranks (the minority op, the rank that never arrived, the rank that died, the rank
that is not in any collective), never by assuming that rank 0 is right.
"""

from __future__ import annotations

import os
from collections import defaultdict

from ..trace import ops
from ..trace.ranges import fmt_ranks
from . import blame, parting

# Verdicts. "stall" means some ranks wait while others still run Python code: it may resolve.
DIVERGED, DEAD, STALL, ELSEWHERE, BACKEND = "diverged", "rank-gone", "stall", "other-group", "backend"


def _where(site: dict | None) -> str:
    if not site:
        return "?"
    via = f" via {site['via']}" if site.get("via") else ""
    return f"{os.path.basename(str(site.get('file', '?')))}:{site.get('line', 0)} {site.get('func', '?')}(){via}"


def _op_label(st: dict) -> str:
    op = st.get("op", "?")
    label = ops.label(op)
    return f"{label} #{st.get('s')}" if st.get("s") else label


def _innermost_user_frame(st: dict) -> list | None:
    for thread in st.get("stacks") or []:
        if thread.get("main"):
            frames = thread.get("frames") or []
            return frames[-1] if frames else None
    return None


def diagnose(statuses: dict[int, dict], world: int, hang_timeout: float, reporter: int,
             members: list[int] | None = None) -> dict:
    """Build the diagnosis. ``statuses[rank]`` has ``state`` (collective | running | exited |
    unknown) and, in a collective, ``op``, ``g``, ``s``, ``site``, ``since_s``."""
    me = statuses.get(reporter, {})
    g0, s0 = me.get("g", "0"), me.get("s")
    ranks = members if members else list(range(world))
    classes: dict[str, list[int]] = defaultdict(list)
    for r in ranks:
        st = statuses.get(r) or {"state": "unknown"}
        state = st.get("state")
        if state == "collective":
            if st.get("g") == g0 and st.get("s") == s0:
                classes["arrived:" + str(st.get("op"))].append(r)
            elif st.get("g") == g0:
                classes["desync"].append(r)
            else:
                classes["elsewhere"].append(r)
        elif state == "running":
            classes["running"].append(r)
        else:
            classes["gone"].append(r)
    arrived_ops = {k: v for k, v in classes.items() if k.startswith("arrived:")}
    culprit: list[int] = []
    reason = ""
    if len(arrived_ops) > 1 or classes.get("desync"):
        verdict = DIVERGED
        groups = dict(arrived_ops)
        if classes.get("desync"):
            groups["desync"] = classes["desync"]
        culprit, reason = _minority(groups, statuses)
    elif classes.get("gone"):
        verdict = DEAD
        culprit = classes["gone"]
        reason = "it exited or stopped answering while the others wait for it"
    elif classes.get("running"):
        verdict = STALL
        culprit = classes["running"]
        reason = "it is not in any collective: the others wait for it"
    elif classes.get("elsewhere"):
        verdict = ELSEWHERE
        culprit = classes["elsewhere"]
        reason = "it waits in a collective of another process group"
    else:
        verdict = BACKEND
        reason = "every rank is inside the same collective: the backend itself does not complete it"
    condition = _condition(culprit, statuses, ranks)
    return {"verdict": verdict, "group": g0, "seq": s0, "op": me.get("op"),
            "hang_timeout_s": hang_timeout, "waited_s": round(float(me.get("since_s", 0.0)), 1),
            "culprit": culprit, "reason": reason, "condition": condition,
            "rows": _rows(statuses, ranks), "reporter": reporter,
            "locations": _locations(statuses, ranks)}


def _locations(statuses: dict[int, dict], ranks: list[int], limit: int = 8) -> list[dict]:
    """Full source locations of where ranks are (one per distinct place)."""
    out: list[dict] = []
    seen: set = set()
    for r in ranks:
        st = statuses.get(r) or {}
        if st.get("state") == "collective" and st.get("site"):
            site, role = st["site"], "wait"
            loc = (site.get("file"), site.get("line"), site.get("func"), site.get("src", ""))
        elif st.get("state") == "running":
            frame, role = _innermost_user_frame(st), "running"
            if not frame:
                continue
            loc = (frame[0], frame[1], frame[2], frame[3] if len(frame) > 3 else "")
        elif st.get("state") == "exited" and (st.get("exit") or {}).get("file"):
            ex, role = st["exit"], "exception"
            loc = (ex.get("file"), ex.get("line"), ex.get("func", ""), "")
        else:
            continue
        if (loc[0], loc[1]) in seen:
            continue
        seen.add((loc[0], loc[1]))
        out.append({"rank": r, "file": loc[0], "line": loc[1], "function": loc[2], "source": loc[3],
                    "role": role})
        if len(out) >= limit:
            break
    return out


def _minority(groups: dict[str, list[int]], statuses: dict[int, dict]) -> tuple[list[int], str]:
    found = blame.minority(groups)
    if found is not None:
        majority_key, culprit = found
        maj = groups[majority_key]
        maj_label = _op_label(statuses[maj[0]]) if majority_key != "desync" else "other calls"
        mine = {(_op_label(statuses[r])) for r in culprit if statuses.get(r, {}).get("state") == "collective"}
        return culprit, f"it issued {', '.join(sorted(mine)) or 'another call'} where " \
                        f"rank{'s' if len(maj) > 1 else ''} {fmt_ranks(maj)} issued {maj_label}"
    labels = "; ".join(f"{fmt_ranks(v)}: {_op_label(statuses[v[0]])}" for v in groups.values())
    if "desync" in groups:
        return [], (f"the ranks are at different positions of the sequence ({labels}): some already "
                    "completed a collective the others are still inside, which happens when they passed "
                    "tensors of different sizes to it or diverged earlier (see collective-mismatch)")
    # A tie. Uneven inputs: one side is in a DDP step and ran more DDP steps than the other.
    steps = {k: max(int(statuses.get(r, {}).get("ddp_steps", 0) or 0) for r in rs) for k, rs in groups.items()}
    ddp_side = [k for k, rs in groups.items()
                if str(statuses.get(rs[0], {}).get("op", "")).startswith("ddp_")]
    if len(ddp_side) == 1 and len(set(steps.values())) > 1 and steps[ddp_side[0]] == max(steps.values()):
        k = ddp_side[0]
        others = "/".join(str(v) for kk, v in steps.items() if kk != k)
        return sorted(groups[k]), (f"uneven inputs: it is in a DDP step after {steps[k]} backward "
                                   f"passes, the others ran {others} ({labels})")
    # Otherwise blame the side whose call sits under a rank-dependent condition the others do not.
    sites = {k: statuses.get(rs[0], {}).get("site") for k, rs in groups.items()}
    before = {k: (statuses.get(rs[0], {}).get("last") or {}).get("site") for k, rs in groups.items()}
    flagged = blame.conditioned_side(sites, before)
    if flagged is not None:
        return sorted(groups[flagged]), f"the ranks disagree ({labels}); its call is under a " \
                                        "rank-dependent condition"
    # One side still inside a loop the other has left through a conditional break/return.
    for _k, k2, loop, exits in blame.left_loops(sites):
        if exits:
            base = os.path.basename(loop["file"])
            return sorted(groups[k2]), (f"the ranks disagree ({labels}); it left the loop at {base}:"
                                        f"{loop['line']} `{loop['text']}` early, through {base}:{exits[0][0]} "
                                        f"`{exits[0][1]}` under {base}:{exits[0][2]} `{exits[0][3]}`")
    return [], f"the ranks disagree ({labels})"


def _condition(culprit: list[int], statuses: dict[int, dict], ranks: list[int]) -> dict | None:
    """The rank-dependent branch the culprit took and the others did not, where their stacks
    parted (``verdict.parting``)."""
    if not culprit:
        return None
    st = statuses.get(culprit[0], {})
    others = [statuses.get(r, {}).get("site") for r in ranks if r not in culprit]
    before = [(statuses.get(r, {}).get("last") or {}).get("site") for r in ranks if r not in culprit]
    b = parting.deciding(parting.branches(st.get("site"), [o for o in others if o], before))
    if b is None:
        return None
    return {"rank": culprit[0], "file": b.file, "line": b.line, "text": b.text,
            "call": _where(st.get("site"))}


def _rows(statuses: dict[int, dict], ranks: list[int]) -> list[list]:
    """Table rows with identical ranks grouped (1-3), so 256 ranks stay a few lines."""
    grouped: dict[tuple, list[int]] = defaultdict(list)
    for r in ranks:
        st = statuses.get(r) or {"state": "unknown"}
        state = st.get("state", "unknown")
        if state == "collective":
            key = ("waiting", _op_label(st), _where(st.get("site")))
        elif state == "running":
            frame = _innermost_user_frame(st)
            where = f"{os.path.basename(str(frame[0]))}:{frame[1]} {frame[2]}()" if frame else "?"
            cpu = st.get("cpu")
            key = (f"running{f' ({cpu:.0f}% CPU)' if isinstance(cpu, (int, float)) else ''}",
                   "not in a collective", where)
        elif state == "exited":
            ex = st.get("exit") or {}
            what = ex.get("exc") or ex.get("how") or "exited"
            where = f"{os.path.basename(str(ex.get('file', '')))}:{ex.get('line')}" if ex.get("file") else "-"
            key = ("exited", str(what)[:70], where)
        else:
            key = (state if state != "unknown" else "no answer", st.get("detail", "-"), "-")
        grouped[key].append(r)
    return [[fmt_ranks(rs), *key] for key, rs in sorted(grouped.items(), key=lambda kv: kv[1][0])]


def render(diag: dict, statuses: dict[int, dict] | None = None) -> str:
    """Terminal text of a diagnosis (tabulate)."""
    from tabulate import tabulate

    title = {DIVERGED: "HANG", DEAD: "HANG", ELSEWHERE: "HANG",
             BACKEND: "SLOW COLLECTIVE (every rank is inside it)",
             STALL: "STALL (possible hang)"}[diag["verdict"]]
    op = diag.get("op") or "?"
    # When the ranks disagree on the op, the reporter's op is only one side of the story.
    what = "" if diag["verdict"] == DIVERGED else f" ({op})"
    lines = [f"ddpdoctor: {title} after {diag.get('waited_s', 0):.0f} s in process group "
             f"{diag.get('group')}, collective #{diag.get('seq')}{what}"]
    table = tabulate(diag["rows"], headers=["rank", "state", "op / where", "call site"], tablefmt="simple")
    lines.extend(" " + t for t in table.splitlines())
    if diag.get("culprit"):
        lines.append(f" culprit: rank{'s' if len(diag['culprit']) > 1 else ''} "
                     f"{fmt_ranks(diag['culprit'])} — {diag['reason']}")
    else:
        lines.append(f" no single culprit: {diag['reason']}")
    cond = diag.get("condition")
    if cond:
        lines.append(f" rank {cond['rank']} reached {cond['call']} through "
                     f"{os.path.basename(str(cond['file']))}:{cond['line']} `{cond['text']}`")
    if statuses and diag["verdict"] in (STALL, DEAD):
        for r in diag["culprit"][:2]:
            st = statuses.get(r) or {}
            for thread in st.get("stacks") or []:
                if not thread.get("main"):
                    continue
                lines.append(f" rank {r} main thread (innermost last):")
                for fr in (thread.get("frames") or [])[-8:]:
                    lines.append(f"    {fr[2]} ({os.path.basename(str(fr[0]))}:{fr[1]})  {fr[3] if len(fr) > 3 else ''}".rstrip())
    if diag["verdict"] == STALL:
        lines.append(" (a stall becomes a hang if it never resolves; ddpdoctor says so if it does)")
    return "\n".join(lines)
