"""Terminal rendering of a run and its findings (tabulate).

Layout: one header line (run, world size, backend), input notes (``note: ...``, one line each),
a per-rank table (ranks with the same summary grouped: ``0-254``), then the findings in report
order (severity, id), each with its ranks, message, source locations, fix and, with
``--verbose``, the per-rank evidence rows.
"""

from __future__ import annotations

import os
import textwrap

from tabulate import tabulate

from ..analysis.findings import Finding
from ..analysis.run import Run
from ..trace.ranges import fmt_ranks

_MARK = {"error": "ERROR", "warning": "WARNING", "info": "info"}
WIDTH = 100
#: Source locations printed per finding (the JSON document has them all).
MAX_LOCATIONS = 8


def _short(text: str, limit: int = 70) -> str:
    from ..analysis.checks._failures import short_error

    return short_error(text, limit)


def _exit_status(rt) -> str:
    ex = rt.exit_record()
    fr = rt.header.get("fr")
    if ex is None and isinstance(fr, dict):  # a Flight Recorder dump: a snapshot, no ending
        return f"FR dump, {fr.get('incomplete', 0)} call(s) unfinished"
    if ex is None:
        return "no exit record (killed?)" + (", trace truncated" if rt.truncated else "")
    how = str(ex.get("how", "?"))
    if how == "exception":
        return (f"raised {_short(str(ex.get('exc', '')))} at "
                f"{os.path.basename(str(ex.get('file')))}:{ex.get('line')}")
    if how == "hang-kill":
        return "ended by ddpdoctor after a hang"
    if how == "crash":  # from faulthandler's dump: the process died in C/C++ code
        where = f" at {os.path.basename(str(ex.get('file')))}:{ex.get('line')}" if ex.get("file") else ""
        return f"crashed: {_short(str(ex.get('exc', '')))}{where}"
    return how


def _rank_rows(run: Run, limit: int = 16) -> list[list]:
    rows = []
    # Ranks with identical summaries are grouped so that 256 ranks do not print 256 lines.
    groups: dict[tuple, list[int]] = {}
    for r, rt in run.ranks.items():
        last = rt.tail[-1] if rt.tail else None
        if last is not None:
            site = rt.site(last.get("site"))
            num = f" #{last.get('s')}" if last.get("s") else ""
            where = f"{last.get('op')}{num} at {os.path.basename(str(site.get('file')))}:{site.get('line')}"
        else:
            where = "-"
        key = (rt.events, where, _exit_status(rt))
        groups.setdefault(key, []).append(r)
    for (events, where, status), ranks in groups.items():
        rows.append([fmt_ranks(ranks), events, where, status])
    if len(rows) > limit:
        rows = rows[:limit] + [["...", "", f"{len(rows) - limit} more rank groups", ""]]
    return rows


def _wrap(text: str, first: str = "    ", rest: str = "    ") -> list[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=first, subsequent_indent=rest,
                         break_on_hyphens=False) or [first.rstrip()]


def render_finding(i: int, f: Finding, verbose: bool = False) -> list[str]:
    """One finding's block of lines."""
    out = [f"[{i}] {_MARK.get(f.severity, f.severity)} {f.id} {f.category} — {f.title}",
           f"    ranks: {fmt_ranks(f.ranks)}"]
    out.extend(_wrap(f.message))
    seen, unique = set(), []
    for loc in f.locations:
        key = (loc.file, loc.line, loc.role)
        if key not in seen:
            seen.add(key)
            unique.append(loc)
    for loc in unique[:MAX_LOCATIONS]:
        func = f" in {loc.function}()" if loc.function and loc.function != "?" else ""
        src = f"  `{loc.source}`" if loc.source else ""
        out.append(f"    at {loc.file}:{loc.line}{func} ({loc.role}, rank {loc.rank}){src}")
    if len(unique) > MAX_LOCATIONS:
        out.append(f"    ... and {len(unique) - MAX_LOCATIONS} more location(s) (see --format json)")
    if f.fix:
        out.extend(_wrap("fix: " + f.fix, "    ", "         "))
    if verbose and f.evidence:
        out.append("    evidence:")
        table = tabulate([[str(c) for c in row] for row in f.evidence], tablefmt="plain")
        out.extend("      " + line for line in table.splitlines())
    return out


def render(run: Run, findings: list[Finding], notes: list[str], verbose: bool = False) -> str:
    out: list[str] = []
    rt0 = next(iter(run.ranks.values()))
    out.append(f"ddpdoctor report: run {run.run_id or '?'} — world size {run.world}, backend "
               f"{run.backend}, torch {rt0.header.get('torch', '?')}, {len(run.ranks)} rank trace(s), "
               f"{run.duration_s():.1f} s")
    if run.missing:
        out.append(f"missing ranks: {fmt_ranks(run.missing)}")
    for n in run.notes + notes:
        out.append(f"note: {n}")
    out.append("")
    try:
        out.append(tabulate(_rank_rows(run), headers=["rank", "events", "last event", "exit"],
                            tablefmt="simple"))
    except Exception as exc:  # damaged input: the findings are still worth printing
        out.append(f"(the rank table could not be shown: {type(exc).__name__}: {exc})")
    out.append("")
    if not findings:
        out.append("No findings: the ranks' traces agree.")
        return "\n".join(out)
    counts: dict[str, int] = {}
    for f in findings:
        counts[f.severity] = counts.get(f.severity, 0) + 1
    out.append("Findings: " + ", ".join(f"{n} {s}{'s' if n > 1 else ''}" for s, n in counts.items()))
    for i, f in enumerate(findings, 1):
        out.append("")
        try:
            out.extend(render_finding(i, f, verbose))
        except Exception as exc:  # a finding built from damaged input must not hide the others
            out.append(f"[{i}] {f.id} {f.category}: could not be shown ({type(exc).__name__}: {exc})")
    return "\n".join(out)
