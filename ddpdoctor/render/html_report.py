"""``--format html``: one self-contained page (inline CSS and SVG, no script, no network).

Trace content is untrusted (file names, source lines, exception texts come from the traced
program): every piece of it goes through ``html.escape``, and a Content-Security-Policy forbids
scripts and every external load, so a hostile string can neither run nor phone home.

A finding about one position of a group's sequence (a divergence, a mismatch, a hang) gets a
swimlane: each rank's calls around that position, re-read from the rank files through the block
offsets the loader kept, with the calls at the position outlined in red. Ranks whose calls in the
window are identical share one lane, so a 256-rank run shows a handful of lanes.
"""

from __future__ import annotations

import html
import os
import time
import zlib

from ..analysis.align import _pending_event
from ..analysis.findings import Finding
from ..analysis.load import BLOCK, read_group_events, signature
from ..analysis.run import Run
from ..trace.ranges import fmt_ranks
from .text import _rank_rows
from .timeline import finding_position, wall0

#: Calls shown before and after the position a finding is about.
BEFORE, AFTER = 6, 3
#: Lanes drawn per swimlane (ranks with identical calls already share one).
MAX_LANES = 16
_CELL_W, _CELL_H, _GAP, _LABEL_W, _HEAD_H = 140, 54, 6, 170, 26

_CSS = """
:root{--fg:#1d2330;--muted:#5b6475;--line:#d9dde5;--bg:#fff;--panel:#f6f7f9;--err:#c62828;
--warn:#b26a00;--info:#1565c0}
*{box-sizing:border-box}
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:var(--fg);
background:var(--bg);margin:0 auto;max-width:1320px;padding:20px 28px 60px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:18px;margin:28px 0 10px;border-bottom:1px solid var(--line);
padding-bottom:4px}h3{font-size:16px;margin:0 0 6px}
code,pre,.mono{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12.5px}
.sub{color:var(--muted)}
dl.summary{display:grid;grid-template-columns:repeat(auto-fill,minmax(190px,1fr));gap:8px;margin:14px 0}
dl.summary div{background:var(--panel);border:1px solid var(--line);border-radius:6px;padding:8px 10px}
dl.summary dt{color:var(--muted);font-size:12px}dl.summary dd{margin:0;font-weight:600}
ul.notes{color:var(--muted);margin:6px 0 0;padding-left:20px}
table{border-collapse:collapse;width:100%;margin:6px 0}
th,td{border-bottom:1px solid var(--line);padding:4px 8px;text-align:left;vertical-align:top}
th{background:var(--panel);font-weight:600;font-size:13px}
.finding{border:1px solid var(--line);border-left:5px solid var(--info);border-radius:6px;
padding:12px 16px;margin:14px 0;background:#fff}
.finding.error{border-left-color:var(--err)}.finding.warning{border-left-color:var(--warn)}
.badge{display:inline-block;border-radius:4px;padding:0 6px;font-size:12px;font-weight:700;color:#fff;
background:var(--info);margin-right:6px;vertical-align:1px}
.badge.error{background:var(--err)}.badge.warning{background:var(--warn)}
.fix{background:#eef7ee;border:1px solid #cfe6cf;border-radius:6px;padding:8px 10px;margin:10px 0 0}
.src{white-space:pre-wrap;word-break:break-all}
.swim{overflow-x:auto;margin:12px 0 0;border:1px solid var(--line);border-radius:6px;
background:var(--panel);padding:8px}
.legend{color:var(--muted);font-size:12px;margin:4px 0 0}
.clean{background:#eef7ee;border:1px solid #cfe6cf;border-radius:6px;padding:10px 14px}
details{margin-top:8px}summary{cursor:pointer;color:var(--muted)}
footer{margin-top:36px;color:var(--muted);font-size:12px}
"""
_CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:; base-uri 'none'; form-action 'none'"


def _e(x) -> str:
    return html.escape(str(x), quote=True)


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[: max(1, n - 1)] + "…"


def _dur(us) -> str:
    try:
        us = float(us)
    except (TypeError, ValueError):
        return ""
    if us < 1000:
        return f"{us / 1000:.2f} ms"
    if us < 1e6:
        return f"{us / 1000:.0f} ms"
    return f"{us / 1e6:.1f} s"


def _fill(op: str) -> str:
    """A stable light colour per op name, so the same op looks the same on every lane."""
    return f"hsl({zlib.crc32(op.encode()) % 360},62%,86%)"


# -- swimlanes ---------------------------------------------------------------------------------
def _window_events(run: Run, rank: int, group: str, lo: int, hi: int) -> dict[int, dict]:
    """This rank's calls lo..hi in the group: re-read from its file, plus calls it never finished."""
    rt = run.ranks[rank]
    out: dict[int, dict] = {}
    gs = rt.groups.get(group)
    b = (lo - 1) // BLOCK
    if gs is not None and b < len(gs.blocks):
        for ev in read_group_events(rt.path, group, gs.blocks[b][2], hi - b * BLOCK):
            s = ev.get("s")
            if isinstance(s, int) and lo <= s <= hi:
                out[s] = ev
    count = gs.count if gs is not None else 0
    for s in range(max(lo, count + 1), hi + 1):
        if s not in out:
            pe = _pending_event(rt, group, s)
            if pe is not None:
                out[s] = pe
    return out


def _lane_key(evs: dict[int, dict]) -> tuple:
    return tuple((s, e.get("op"), signature(e), bool(e.get("pending")), "err" in e)
                 for s, e in sorted(evs.items()))


def _tooltip(run: Run, rank_label: str, rank: int, ev: dict) -> str:
    rt = run.ranks[rank]
    site = rt.site(ev.get("site"))
    lines = [f"{rank_label}: {ev.get('op')} #{ev.get('s')} in group {ev.get('g', '0')}"]
    for key, label in (("x", "tensors"), ("rop", "reduce op"), ("root", "root"), ("nobj", "objects")):
        if key in ev:
            lines.append(f"{label}: {ev[key]}")
    if ev.get("pending"):
        lines.append("never returned: still waiting in this call")
    elif "d" in ev:
        lines.append(f"time inside the call: {ev.get('d', 0) / 1000:.3f} ms")
    lines.append(f"at {site.get('file', '?')}:{site.get('line', 0)} {site.get('func', '')}")
    if site.get("src"):
        lines.append(str(site.get("src")))
    if ev.get("err"):
        lines.append("raised: " + str(ev.get("err"))[:300])
    return "\n".join(lines)


def swimlane_svg(run: Run, group: str, seq: int, culprits: list[int]) -> str:
    """An SVG of every member's calls around position ``seq`` of ``group`` ("" if none)."""
    members = [r for r in run.group_members(group) if r in run.ranks]
    if not members:
        return ""
    lo, hi = max(1, seq - BEFORE), seq + AFTER
    lanes: dict[tuple, list[int]] = {}
    lane_events: dict[tuple, dict[int, dict]] = {}
    for r in members:
        evs = _window_events(run, r, group, lo, hi)
        key = _lane_key(evs)
        lanes.setdefault(key, []).append(r)
        lane_events.setdefault(key, evs)
    # Drop trailing positions nobody reached, keep at least the finding's own position.
    reached = [s for evs in lane_events.values() for s in evs]
    hi = max([seq] + reached)
    cols = list(range(lo, hi + 1))
    keys = list(lanes)[:MAX_LANES]
    width = _LABEL_W + len(cols) * (_CELL_W + _GAP) + _GAP
    height = _HEAD_H + len(keys) * (_CELL_H + _GAP) + _GAP
    culprit_set = set(culprits)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" role="img" font-family="ui-monospace,Menlo,Consolas,monospace" '
             f'font-size="12"><title>{_e(f"process group {group}: calls #{lo}-#{hi} per rank")}</title>']
    xcol = {s: _LABEL_W + _GAP + i * (_CELL_W + _GAP) for i, s in enumerate(cols)}
    # The column of the position the finding is about.
    parts.append(f'<rect x="{xcol[seq] - _GAP // 2}" y="2" width="{_CELL_W + _GAP}" '
                 f'height="{height - 4}" fill="#fde3e3" rx="4"/>')
    for s in cols:
        weight = ' font-weight="700" fill="#c62828"' if s == seq else ' fill="#5b6475"'
        parts.append(f'<text x="{xcol[s] + _CELL_W // 2}" y="17" text-anchor="middle"{weight}>#{s}</text>')
    for li, key in enumerate(keys):
        ranks = lanes[key]
        evs = lane_events[key]
        y = _HEAD_H + li * (_CELL_H + _GAP)
        label = ("rank " if len(ranks) == 1 else "ranks ") + fmt_ranks(ranks)
        is_culprit = bool(culprit_set.intersection(ranks))
        colour = "#c62828" if is_culprit else "#1d2330"
        head = label if len(ranks) == 1 else f"{len(ranks)} ranks"
        parts.append(f'<g><title>{_e(label)}</title><text x="8" y="{y + 18}" font-weight="700" '
                     f'fill="{colour}">{_e(_clip(head, 22))}</text>')
        if len(ranks) > 1:
            parts.append(f'<text x="8" y="{y + 32}" fill="{colour}" font-size="11">'
                         f'{_e(_clip(fmt_ranks(ranks), 24))}</text>')
        if is_culprit:
            parts.append(f'<text x="8" y="{y + (46 if len(ranks) > 1 else 32)}" fill="#c62828" '
                         f'font-size="11">culprit</text>')
        parts.append("</g>")
        for s in cols:
            x = xcol[s]
            ev = evs.get(s)
            hot = s == seq
            if ev is None:
                stroke = ' stroke="#c62828" stroke-width="2" stroke-dasharray="5 4"' if hot else \
                    ' stroke="#b8bfcc" stroke-dasharray="3 3"'
                parts.append(f'<g><title>{_e(f"{label}: no call #{s} in group {group}")}</title>'
                             f'<rect x="{x}" y="{y}" width="{_CELL_W}" height="{_CELL_H}" rx="5" '
                             f'fill="#ffffff"{stroke}/><text x="{x + _CELL_W // 2}" y="{y + 31}" '
                             f'text-anchor="middle" fill="#8a93a3">no call</text></g>')
                continue
            op = str(ev.get("op", "?"))
            pending = bool(ev.get("pending"))
            if hot:
                stroke = ' stroke="#c62828" stroke-width="3"'
            elif "err" in ev:
                stroke = ' stroke="#c62828" stroke-width="1"'
            else:
                stroke = ' stroke="#7d8797" stroke-width="1"'
            if pending:
                stroke += ' stroke-dasharray="6 3"'
            shape = ",".join(map(str, ev.get("x") or [])) or (f"{ev.get('nobj')} obj" if "nobj" in ev else "")
            if pending:
                third, tcol = "never returned", "#c62828"
            elif "err" in ev:
                third, tcol = f"raised after {_dur(ev.get('d'))}", "#c62828"
            else:
                third, tcol = _dur(ev.get("d")), "#3c4556"
            parts.append(f'<g><title>{_e(_tooltip(run, label, ranks[0], ev))}</title>'
                         f'<rect x="{x}" y="{y}" width="{_CELL_W}" height="{_CELL_H}" rx="5" '
                         f'fill="{_fill(op)}"{stroke}/>'
                         f'<text x="{x + 7}" y="{y + 18}" font-weight="700">{_e(_clip(op, 18))}</text>'
                         f'<text x="{x + 7}" y="{y + 32}" fill="#3c4556" font-size="11">{_e(_clip(shape, 20))}</text>'
                         f'<text x="{x + 7}" y="{y + 46}" fill="{tcol}" font-size="11">{_e(_clip(third, 20))}</text>'
                         f'</g>')
    parts.append("</svg>")
    more = len(lanes) - len(keys)
    note = f'<p class="legend">{more} more lane(s) not drawn.</p>' if more > 0 else ""
    return "".join(parts) + note


# -- page --------------------------------------------------------------------------------------
def _int(v) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return 0


def _span_s(run: Run) -> float:
    """From the earliest rank start to the latest end of a call or exit (Run.duration_s counts
    to the start of the last call, which hides a final 30-minute wait)."""
    base = min(wall0(rt) for rt in run.ranks.values())
    end = 0.0
    for rt in run.ranks.values():
        local = _int(rt.last_ts)
        for ev in rt.tail:
            local = max(local, _int(ev.get("ts")) + _int(ev.get("d")))
        ex = rt.exit_record()
        if ex is not None:
            local = max(local, _int(ex.get("ts")))
        end = max(end, wall0(rt) - base + local / 1e6)
    return end


def _summary(run: Run, findings: list[Finding]) -> str:
    rt0 = next(iter(run.ranks.values()))
    events = sum(rt.events for rt in run.ranks.values())
    items = [("run", run.run_id or "?"), ("world size", run.world), ("backend", run.backend),
             ("torch", rt0.header.get("torch", "?")), ("rank traces", f"{len(run.ranks)} of {run.world}"),
             ("missing ranks", fmt_ranks(run.missing) if run.missing else "none"),
             ("duration", f"{_span_s(run):.1f} s"), ("recorded calls", events),
             ("restart attempt", run.attempt), ("findings", len(findings))]
    return '<dl class="summary">' + "".join(f"<div><dt>{_e(k)}</dt><dd>{_e(v)}</dd></div>"
                                            for k, v in items) + "</dl>"


def _locations_table(f: Finding) -> str:
    seen = set()
    rows = []
    for loc in f.locations[:12]:
        key = (loc.file, loc.line, loc.role, loc.rank)
        if key in seen:
            continue
        seen.add(key)
        rows.append(f"<tr><td>{_e(loc.rank)}</td><td>{_e(loc.role)}</td>"
                    f'<td class="mono">{_e(loc.file)}:{_e(loc.line)}</td><td class="mono">{_e(loc.function)}</td>'
                    f'<td><code class="src">{_e(loc.source)}</code></td></tr>')
    if not rows:
        return ""
    return ("<table><thead><tr><th>rank</th><th>role</th><th>where</th><th>function</th>"
            "<th>source line</th></tr></thead><tbody>" + "".join(rows) + "</tbody></table>")


def _evidence(f: Finding) -> str:
    if not f.evidence:
        return ""
    rows = "".join("<tr>" + "".join(f'<td class="mono">{_e(c)}</td>' for c in row) + "</tr>"
                   for row in f.evidence[:64])
    return f"<details><summary>per-rank evidence ({len(f.evidence)} rows)</summary><table>{rows}</table></details>"


def _culprits(f: Finding) -> list[int]:
    """The ranks to mark: the check's culprit (its data or hang diagnosis), else the finding's ranks."""
    diag = f.data.get("diagnosis")
    found = f.data.get("culprit") or (diag.get("culprit") if isinstance(diag, dict) else None) or f.ranks
    out = []
    for c in found if isinstance(found, list) else []:
        try:
            out.append(int(c))
        except (TypeError, ValueError):
            continue
    return out


def _finding(run: Run, i: int, f: Finding) -> str:
    sev = f.severity if f.severity in ("error", "warning", "info") else "info"
    out = [f'<section class="finding {sev}" id="finding-{i}">',
           f'<h3><span class="badge {sev}">{_e(f.severity.upper())}</span>[{i}] {_e(f.id)} '
           f'<span class="sub">{_e(f.category)}</span> — {_e(f.title)}</h3>',
           f'<p class="sub">ranks: {_e(fmt_ranks(f.ranks))}</p>', f"<p>{_e(f.message)}</p>",
           _locations_table(f)]
    pos = finding_position(f)
    if pos is not None:
        group, seq = pos
        try:
            svg = swimlane_svg(run, group, seq, _culprits(f))
        except (OSError, ValueError, KeyError, TypeError):  # a damaged file must not lose the report
            svg = ""
        if svg:
            out.append(f'<div class="swim">{svg}</div><p class="legend">Process group {_e(group)}: each '
                       f"lane is a rank (ranks with identical calls share one), each box a call in "
                       f"order. Red outline: the calls at #{_e(seq)}, where the ranks differ; dashed: a "
                       f"call that never returned; hover a box for its shapes and source line.</p>")
    if f.fix:
        out.append(f'<p class="fix"><strong>Fix:</strong> {_e(f.fix)}</p>')
    out.append(_evidence(f))
    out.append("</section>")
    return "".join(out)


def render(run: Run, findings: list[Finding], notes: list[str]) -> str:
    """The whole report as one HTML document."""
    rt0 = next(iter(run.ranks.values()))
    argv = " ".join(map(str, rt0.header.get("argv") or []))
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">',
           '<meta name="viewport" content="width=device-width, initial-scale=1">',
           f"<title>ddpdoctor report — run {_e(run.run_id or '?')}</title><style>{_CSS}</style></head><body>",
           "<header><h1>ddpdoctor report</h1>",
           f'<div class="sub mono">{_e(_clip(argv, 300))}</div></header>', _summary(run, findings)]
    all_notes = list(notes) + list(run.notes)
    if all_notes:
        out.append('<ul class="notes">' + "".join(f"<li>{_e(n)}</li>" for n in all_notes) + "</ul>")
    out.append("<h2>Findings</h2>")
    if not findings:
        out.append('<p class="clean">No findings: the ranks\' traces agree.</p>')
    else:
        counts: dict[str, int] = {}
        for f in findings:
            counts[f.severity] = counts.get(f.severity, 0) + 1
        out.append("<p>" + ", ".join(f"{n} {_e(s)}{'s' if n > 1 else ''}" for s, n in counts.items())
                   + "</p>")
        for i, f in enumerate(findings, 1):
            try:
                out.append(_finding(run, i, f))
            except Exception as exc:  # a finding built from damaged input must not hide the others
                out.append(f'<section class="finding info" id="finding-{i}"><h3>[{i}] {_e(f.id)} '
                           f"{_e(f.category)}</h3><p>could not be shown ({_e(type(exc).__name__)}: "
                           f"{_e(exc)})</p></section>")
    out.append("<h2>Ranks</h2><table><thead><tr><th>rank(s)</th><th>calls</th><th>last call</th>"
               "<th>exit</th></tr></thead><tbody>")
    try:
        rows = _rank_rows(run, limit=64)
    except Exception as exc:  # damaged input: the findings are still worth showing
        rows = [["?", "", f"the rank table could not be shown ({type(exc).__name__})", ""]]
    for row in rows:
        out.append("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in row) + "</tr>")
    out.append("</tbody></table>")
    files = ", ".join(sorted({os.path.dirname(rt.path) or "." for rt in run.ranks.values()}))
    out.append(f"<footer>Generated by ddpdoctor on {_e(time.strftime('%Y-%m-%d %H:%M:%S'))} from "
               f"{_e(files)}. This page loads nothing from the network. For every call of every rank on a "
               f"time axis: <code>ddpdoctor timeline DIR -o run.json</code>, opened in Perfetto.</footer></body></html>")
    return "\n".join(out)
