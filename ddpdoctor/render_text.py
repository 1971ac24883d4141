"""Terminal rendering of a run and its findings (tabulate)."""

from __future__ import annotations

import os
import textwrap

from tabulate import tabulate

from .findings import Finding
from .ranges import fmt_ranks
from .run import Run

_MARK = {"error": "ERROR", "warning": "WARNING", "info": "info"}


def _rank_rows(run: Run, limit: int = 16) -> list[list]:
    rows = []
    # Ranks with identical summaries are grouped so that 256 ranks do not print 256 lines.
    groups: dict[tuple, list[int]] = {}
    for r, rt in run.ranks.items():
        last = rt.tail[-1] if rt.tail else None
        ex = rt.exit_record()
        status = "no exit record (killed?)" if ex is None else ex.get("how", "?")
        if ex is not None and ex.get("how") == "exception":
            status = f"raised {str(ex.get('exc', ''))[:60]} at {os.path.basename(str(ex.get('file')))}:{ex.get('line')}"
        if last is not None:
            site = rt.site(last.get("site"))
            where = f"{last.get('op')} #{last.get('s')} at {os.path.basename(str(site.get('file')))}:{site.get('line')}"
        else:
            where = "-"
        key = (rt.events, where, status)
        groups.setdefault(key, []).append(r)
    for (events, where, status), ranks in groups.items():
        rows.append([fmt_ranks(ranks), events, where, status])
    if len(rows) > limit:
        rows = rows[:limit] + [["...", "", f"{len(rows) - limit} more rank groups", ""]]
    return rows


def render(run: Run, findings: list[Finding], notes: list[str], verbose: bool = False) -> str:
    out: list[str] = []
    rt0 = next(iter(run.ranks.values()))
    out.append(f"ddpdoctor report: run {run.run_id or '?'} — world size {run.world}, backend "
               f"{run.backend}, torch {rt0.header.get('torch', '?')}, {len(run.ranks)} rank trace(s), "
               f"{run.duration_s():.1f} s")
    if run.missing:
        out.append(f"missing ranks: {fmt_ranks(run.missing)}")
    for n in notes + run.notes:
        out.append(f"note: {n}")
    out.append("")
    out.append(tabulate(_rank_rows(run), headers=["rank", "events", "last event", "exit"],
                        tablefmt="simple"))
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
        out.append(f"[{i}] {_MARK.get(f.severity, f.severity)} {f.id} {f.category} — {f.title}")
        out.append(f"    ranks: {fmt_ranks(f.ranks)}")
        out.extend(textwrap.wrap(f.message, 100, initial_indent="    ", subsequent_indent="    "))
        seen = set()
        for loc in f.locations[:8]:
            key = (loc.file, loc.line, loc.role)
            if key in seen:
                continue
            seen.add(key)
            src = f"  `{loc.source}`" if loc.source else ""
            out.append(f"    at {loc.file}:{loc.line} ({loc.role}, rank {loc.rank}){src}")
        if f.fix:
            out.extend(textwrap.wrap("fix: " + f.fix, 100, initial_indent="    ", subsequent_indent="         "))
        if verbose and f.evidence:
            table = tabulate(f.evidence, tablefmt="plain")
            out.extend("      " + line for line in table.splitlines())
    return "\n".join(out)
