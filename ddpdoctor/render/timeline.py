"""``ddpdoctor timeline``: the run as a Chrome Trace Event file that Perfetto and chrome://tracing open.

One process per rank, one complete slice (``ph: "X"``) per recorded call: the slice's duration is
the time the rank spent inside the call, so waiting for late peers is visible as long slices.
Hang and crash points and the report's findings are instant events (``ph: "i"``).

Ranks are aligned on wall-clock time: every header has ``wall0`` (unix seconds when the rank's
recorder started) and events carry ``ts`` in µs since then, so an event's place on the common axis
is ``(wall0 - earliest wall0) * 1e6 + ts``. Ranks on different hosts are only as aligned as the
hosts' clocks (NTP: usually within a millisecond).

The rank files are streamed one after the other and every event is written as soon as it is
read, so memory stays bounded by the per-rank bookkeeping, never by the number of events.
"""

from __future__ import annotations

import json
import os
import sys
from bisect import bisect_left
from collections import defaultdict

from ..analysis.findings import Finding
from ..analysis.run import Run
from ..trace import ops
from ..trace.ranges import fmt_ranks
from ..trace.records import InFlight

#: Tracks (threads) of a rank's process, in display order.
TRACK_COLLECTIVES, TRACK_DDP, TRACK_P2P, TRACK_WAIT, TRACK_MARKS, TRACK_FINDINGS = 1, 2, 3, 4, 5, 6
_TRACK_NAMES = {TRACK_COLLECTIVES: "collectives", TRACK_DDP: "DDP steps", TRACK_P2P: "p2p",
                TRACK_WAIT: "async waits", TRACK_MARKS: "hang / crash / exit",
                TRACK_FINDINGS: "findings"}
#: A track whose slices would overlap without nesting spills into extra lanes (at most 99).
_LANE_STRIDE = 100
#: Viewers treat pid/tid 0 specially and tids as unique across processes (Linux semantics), so
#: rank r is pid r+1 and its tracks are tids (r+1)*_TID_BASE + track*_LANE_STRIDE + lane.
_TID_BASE = 1000
_DDP_OPS = ops.DDP_OPS
#: Top-level intervals remembered per lane to check nesting (older ones are forgotten).
_LANE_MEMORY = 4096


def parse_ranks(spec: str | None) -> set[int] | None:
    """``"0-3,8"`` -> {0, 1, 2, 3, 8}; None for no filter. Raises ValueError on bad input."""
    if spec is None or not spec.strip():
        return None
    out: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            if "-" in part:
                a, b = part.split("-", 1)
                lo, hi = int(a), int(b)
                if lo < 0 or hi < lo:
                    raise ValueError
                out.update(range(lo, hi + 1))
            else:
                r = int(part)
                if r < 0:
                    raise ValueError
                out.add(r)
        except ValueError:
            raise ValueError(f"bad --ranks {spec!r}: expected ranks and ranges such as 0-3,8") from None
    if not out:
        raise ValueError(f"bad --ranks {spec!r}: expected ranks and ranges such as 0-3,8")
    return out


def parse_window(spec: str | None) -> tuple[float, float] | None:
    """``"10:20"`` (seconds from the run's start; either side may be empty) -> (start_us, end_us)."""
    if spec is None or not spec.strip():
        return None
    msg = f"bad --window {spec!r}: expected START:END in seconds from the run's start, e.g. 10:20"
    if ":" not in spec:
        raise ValueError(msg)
    a, b = spec.split(":", 1)
    try:
        lo = float(a) if a.strip() else 0.0
        hi = float(b) if b.strip() else float("inf")
    except ValueError:
        raise ValueError(msg) from None
    if lo != lo or hi != hi or lo < 0 or hi <= lo:  # NaN, negative or empty windows
        raise ValueError(msg)
    return lo * 1e6, hi * 1e6


class _Lanes:
    """Places slices of one track on lanes where they nest properly.

    Trace viewers require the complete events of one thread to nest (a slice either contains
    another or is disjoint from it). Calls of one Python thread always do; calls from several
    threads of a rank (which the trace does not tell apart) may not, and those go to a new lane.
    A lane is a forest: each level holds sorted, disjoint nodes ``[start, end, starts, kids]``.
    """

    def __init__(self) -> None:
        self.lanes: list[tuple[list[int], list[list]]] = []  # per lane: (starts, nodes) of the top level

    def place(self, s: int, e: int) -> int:
        for i, (starts, nodes) in enumerate(self.lanes):
            if self._fit(starts, nodes, s, e):
                return i
        lane: tuple[list[int], list[list]] = ([], [])
        self._fit(lane[0], lane[1], s, e)
        self.lanes.append(lane)
        return len(self.lanes) - 1

    @classmethod
    def _fit(cls, starts: list[int], nodes: list[list], s: int, e: int) -> bool:
        hi = bisect_left(starts, e if e > s else e + 1)  # nodes starting before the slice ends
        lo = hi
        while lo > 0 and nodes[lo - 1][1] > s:  # ... and ending after it starts (ends are sorted)
            lo -= 1
        over = nodes[lo:hi]
        if not over:
            starts.insert(hi, s)
            nodes.insert(hi, [s, e, [], []])
        elif len(over) == 1 and over[0][0] <= s and e <= over[0][1]:
            return cls._fit(over[0][2], over[0][3], s, e)  # inside one node: place among its kids
        elif all(s <= n[0] and n[1] <= e for n in over):
            starts[lo:hi] = [s]
            nodes[lo:hi] = [[s, e, [n[0] for n in over], over]]
        else:
            return False
        if len(nodes) > _LANE_MEMORY:  # old slices are rarely revisited: bounded memory
            del starts[: _LANE_MEMORY // 2]
            del nodes[: _LANE_MEMORY // 2]
        return True


class _Writer:
    """Streams ``traceEvents`` into the output file, one event at a time."""

    def __init__(self, f) -> None:
        self.f = f
        self.count = 0

    _encode = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode

    def event(self, ev: dict) -> None:
        try:
            text = self._encode(ev)
        except (ValueError, TypeError):  # NaN/inf or odd values from an untrusted trace
            ev = dict(ev, args={k: str(v) for k, v in (ev.get("args") or {}).items()})
            text = json.dumps(ev, separators=(",", ":"), default=str)
        self.f.write(("\n" if self.count == 0 else ",\n") + text)
        self.count += 1


class _Sites:
    """A rank's call sites as slice arguments, built once per site."""

    def __init__(self, sites: dict) -> None:
        self.sites = sites
        self.cache: dict = {}

    def args(self, sid) -> dict:
        out = self.cache.get(sid)
        if out is None:
            s = self.sites.get(sid) if isinstance(sid, (int, str)) else None
            out = {}
            if s:
                out["call_site"] = f"{s.get('file', '?')}:{s.get('line', 0)} {s.get('func', '')}"
                if s.get("src"):
                    out["source"] = s.get("src")
                if s.get("via"):
                    out["via"] = s.get("via")
            if isinstance(sid, (int, str)):
                self.cache[sid] = out
        return out


#: Record keys shown in a slice's args, under readable names.
_ARG_NAMES = {"g": "group", "s": "seq", "x": "shapes", "xo": "other_tensors", "n": "numel",
              "rop": "reduce_op", "root": "root", "groot": "group_root", "nobj": "objects",
              "obj": "object", "ch": "channel", "step": "step", "bufs": "syncs_buffers",
              "ddp_overlap": "ddp_overlap", "batch": "batch", "async": "async", "err": "error"}


def _event_args(rec: dict, sites: _Sites) -> dict:
    names = _ARG_NAMES
    args = {names[k]: v for k, v in rec.items() if k in names}
    args["time_inside_ms"] = _num(rec.get("d")) / 1000
    args.update(sites.args(rec.get("site")))
    return args


def wall0(rt) -> float:
    """Unix time at which a rank's recorder started (0 when the header lacks a usable one)."""
    try:
        w = float(rt.header.get("wall0", 0) or 0)
    except (TypeError, ValueError):
        return 0.0
    return w if w == w and abs(w) != float("inf") else 0.0


def _num(v) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return 0


class _RankWriter:
    """Writes one rank's events: lanes, window filter, markers."""

    def __init__(self, out: _Writer, pid: int, offset_us: int, window, sites: dict) -> None:
        self.out, self.pid, self.offset, self.window = out, pid, offset_us, window
        self.sites = _Sites(sites)
        self.lanes: dict[int, _Lanes] = defaultdict(_Lanes)
        self.named: set[int] = set()

    def _tid(self, track: int, s: int, e: int) -> int:
        lane = min(self.lanes[track].place(s, e), _LANE_STRIDE - 1)
        tid = self.pid * _TID_BASE + track * _LANE_STRIDE + lane
        if tid not in self.named:
            self.named.add(tid)
            name = _TRACK_NAMES[track] + (f" ({lane + 1})" if lane else "")
            self.out.event({"ph": "M", "name": "thread_name", "pid": self.pid, "tid": tid, "ts": 0,
                            "args": {"name": name}})
            self.out.event({"ph": "M", "name": "thread_sort_index", "pid": self.pid, "tid": tid,
                            "ts": 0, "args": {"sort_index": track * _LANE_STRIDE + lane}})
        return tid

    def _inside(self, s: int, e: int) -> bool:
        w = self.window
        return w is None or (e >= w[0] and s <= w[1])

    def slice(self, track: int, name: str, ts_local: int, dur: int, args: dict, cat: str,
              error: bool = False) -> None:
        s = self.offset + ts_local
        dur = max(0, dur)
        if not self._inside(s, s + dur):
            return
        ev = {"ph": "X", "name": name, "cat": cat, "pid": self.pid, "tid": self._tid(track, s, s + dur),
              "ts": s, "dur": dur, "args": args}
        if error:
            ev["cname"] = "terrible"  # catapult's colour names; Perfetto ignores it
        self.out.event(ev)

    def instant(self, track: int, name: str, ts_local: int, args: dict, cat: str) -> None:
        s = self.offset + ts_local
        if not self._inside(s, s):
            return
        self.out.event({"ph": "i", "s": "t", "name": name, "cat": cat, "pid": self.pid,
                        "tid": self._tid(track, s, s), "ts": s, "args": args})


def finding_position(f: Finding) -> tuple[str, int] | None:
    """The (group, sequence number) a finding is about, from its data or its hang diagnosis."""
    for d in (f.data, f.data.get("diagnosis")):
        if isinstance(d, dict):
            g, s = d.get("group"), d.get("seq")
            if g is not None and isinstance(s, int) and not isinstance(s, bool) and s > 0:
                return str(g), s
    return None


def _hang_args(rec: dict) -> dict:
    """The gist of a watchdog record (its statuses carry every thread's stack: left out)."""
    args = {k: rec[k] for k in ("role", "ep", "waited_s") if k in rec}
    st = rec.get("status")
    if isinstance(st, dict):
        args["state"] = {k: st[k] for k in ("state", "op", "g", "s", "since_s", "cpu") if k in st}
    diag = rec.get("diag")
    if isinstance(diag, dict):
        args["diagnosis"] = {k: diag[k] for k in ("verdict", "group", "seq", "op", "culprit", "reason",
                                                   "waited_s") if k in diag}
    return args


def _finding_args(f: Finding) -> dict:
    args = {"id": f.id, "category": f.category, "severity": f.severity, "title": f.title,
            "ranks": fmt_ranks(f.ranks), "message": f.message}
    if f.fix:
        args["fix"] = f.fix
    locs = [f"{loc.file}:{loc.line} ({loc.role}, rank {loc.rank}) {loc.source}".rstrip()
            for loc in f.locations[:8]]
    if locs:
        args["locations"] = locs
    return args


def _findings_by_rank(findings: list[Finding]) -> dict[int, list[Finding]]:
    """A finding concerns the ranks it names and the ranks of its source locations."""
    out: dict[int, list[Finding]] = defaultdict(list)
    for f in findings:
        for r in sorted(set(f.ranks) | {loc.rank for loc in f.locations}):
            out[r].append(f)
    return out


def _stream_rank(out: _Writer, rt, pid: int, offset_us: int, window, findings: list[Finding]) -> None:
    rw = _RankWriter(out, pid, offset_us, window, rt.sites)
    host = rt.header.get("host", "?")
    out.event({"ph": "M", "name": "process_name", "pid": pid, "tid": pid * _TID_BASE, "ts": 0,
               "args": {"name": f"rank {rt.rank} ({host})"}})
    out.event({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": pid * _TID_BASE, "ts": 0,
               "args": {"sort_index": rt.rank}})
    # Where each finding of this rank sits: the rank's own call at the finding's (group, seq).
    wanted: dict[tuple[str, int], list[Finding]] = defaultdict(list)
    placed: dict[int, int] = {}  # id(finding) -> local ts
    for f in findings:
        pos = finding_position(f)
        if pos is not None:
            wanted[pos].append(f)
    open_calls: dict[tuple, dict] = {}  # (g, s, op) -> pending record, until the call completes
    exit_rec: dict | None = None
    last_ts = 0
    from ..analysis.conform import bounded_lines, parse_line
    from ..trace.files import open_regular

    try:
        f = open_regular(rt.path)  # a regular file only, read in lines of bounded length
    except OSError:
        return
    with f:
        for _start, raw in bounded_lines(f):
            if raw is None:
                continue  # an over-long line: corrupt
            if not raw.endswith(b"\n"):
                break  # a rank killed mid-write
            try:
                rec = parse_line(raw)
            except (ValueError, RecursionError):
                continue
            if not isinstance(rec, dict):
                continue
            t = rec.get("t")
            if t not in ("c", "p", "w", "e", "pending", "hang", "exit"):
                continue
            ts = _num(rec.get("ts"))
            dur = _num(rec.get("d"))
            last_ts = max(last_ts, ts + dur)
            op = str(rec.get("op", "?"))
            if t == "c" or (t == "e" and "d" in rec):
                key = (str(rec.get("g", "0")), _num(rec.get("s")))
                open_calls.pop((key[0], key[1], op), None)
                for fnd in wanted.get(key, ()):
                    placed.setdefault(id(fnd), ts)
                track = TRACK_DDP if op in _DDP_OPS else TRACK_COLLECTIVES
                rw.slice(track, op, ts, dur, _event_args(rec, rw.sites),
                         "ddp" if track == TRACK_DDP else "collective", error="err" in rec)
            elif t == "p":
                rw.slice(TRACK_P2P, f"{op} {rec.get('ch', '?')}", ts, dur, _event_args(rec, rw.sites),
                         "p2p", error="err" in rec)
            elif t == "w":
                rw.slice(TRACK_WAIT, f"wait {op}", ts, dur, _event_args(rec, rw.sites), "wait")
            elif t == "e":
                rw.instant(TRACK_DDP, op, ts, _event_args(rec, rw.sites), "ddp")
            elif t == "pending":
                open_calls[(str(rec.get("g", "0")), _num(rec.get("s")), op)] = rec
                rw.instant(TRACK_MARKS, f"pending: {op} #{rec.get('s', '?')}", ts,
                           dict(_event_args(rec, rw.sites), note="still inside this call when the "
                                "watchdog looked"), "hang")
            elif t == "hang":
                role = rec.get("role")
                name = {"reporter": "hang diagnosed", "local": "hang diagnosed",
                        "member": "hang: position reported", "resolved": "hang resolved"}.get(role, "hang")
                rw.instant(TRACK_MARKS, name, ts, _hang_args(rec), "hang")
            elif t == "exit":
                exit_rec = rec
                # In flight at exit; a call may still complete after this record (killed peers
                # make it raise), and then its own record closes it below.
                for inf in map(InFlight.decode, rec.get("inflight") or []):
                    if inf is not None:
                        open_calls.setdefault((str(inf.g), _num(inf.s), str(inf.op)),
                                              {"op": inf.op, "g": inf.g, "s": inf.s, "site": inf.site,
                                               "ts": inf.ts})
    end = last_ts
    if exit_rec is not None:
        end = max(end, _num(exit_rec.get("ts")))
        how = exit_rec.get("how", "?")
        args = {k: v for k, v in exit_rec.items() if k not in ("t", "ts", "inflight")}
        if how == "exception":
            where = f"{os.path.basename(str(exit_rec.get('file', '?')))}:{exit_rec.get('line', 0)}"
            name = f"crash: {str(exit_rec.get('exc', '?')).split(':', 1)[0]} at {where}"
        elif how == "normal":
            name = "exit"
        else:
            name = f"exit ({how})"
        rw.instant(TRACK_MARKS, name, _num(exit_rec.get("ts")), args, "exit")
    else:
        rw.instant(TRACK_MARKS, "no exit record (killed?)", end,
                   {"note": "the trace ends here without an exit record: the rank was killed "
                            "(SIGKILL, OOM) or is still running"}, "exit")
    # Calls that never returned: a slice from their start to the rank's last sign of life.
    for (g, s, op), rec in open_calls.items():
        ts = _num(rec.get("ts"))
        for fnd in wanted.get((g, s), ()):
            placed.setdefault(id(fnd), ts)
        track = TRACK_DDP if op.split(".")[0] in _DDP_OPS else TRACK_COLLECTIVES
        args = dict(_event_args(rec, rw.sites), never_returned=True)
        args.pop("time_inside_ms", None)
        rw.slice(track, op, ts, max(0, end - ts), args, "collective", error=True)
    for fnd in findings:
        ts = placed.get(id(fnd), end)
        args = _finding_args(fnd)
        if id(fnd) not in placed:
            args["position"] = "not tied to one call of this rank: shown at the end of its trace"
        rw.instant(TRACK_FINDINGS, f"{fnd.severity.upper()} {fnd.id} {fnd.category}", ts, args,
                   "finding")


def write(paths: list[str], output: str, ranks: str | None = None, window: str | None = None) -> int:
    """Write the timeline of the run in ``paths`` to ``output``; returns the number of events.

    ``ranks`` ("0-3,8") and ``window`` ("10:20", seconds from the run's start) filter what is
    written. Raises ValueError for a bad filter, TraceError for unusable input.
    """
    from ..analysis.engine import analyze_run
    from ..analysis.run import load_run

    want = parse_ranks(ranks)
    win = parse_window(window)
    run: Run = load_run(list(paths))
    from ..trace.safetext import for_terminal

    for note in run.notes:  # which run/attempt was chosen, unreadable files: worth knowing here too
        print(for_terminal(f"ddpdoctor: note: {note}"), file=sys.stderr)
    selected = [r for r in run.ranks if want is None or r in want]
    if not selected:
        raise ValueError(f"--ranks {ranks}: none of these ranks is in the run "
                         f"(ranks found: {fmt_ranks(run.ranks)})")
    try:
        findings = analyze_run(run).findings
    except Exception as exc:  # the timeline is still worth having without the findings
        findings = []
        print(f"ddpdoctor: warning: the checks could not run ({type(exc).__name__}: {exc}); "
              "the timeline has no findings", file=sys.stderr)
    by_rank = _findings_by_rank(findings)
    base = min(wall0(rt) for rt in run.ranks.values())
    tmp = output + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        meta = {"tool": "ddpdoctor", "run": run.run_id, "attempt": run.attempt, "world_size": run.world,
                "ranks": fmt_ranks(selected), "wall0": base,
                "time_zero": "earliest rank start (unix seconds in wall0)"}
        if window:
            meta["window"] = window
        f.write('{"displayTimeUnit":"ms","otherData":' + json.dumps(meta) + ',"traceEvents":[')
        out = _Writer(f)
        for r in selected:
            rt = run.ranks[r]
            try:
                offset = int(round((wall0(rt) - base) * 1e6))
                _stream_rank(out, rt, r + 1, offset, win, by_rank.get(r, []))
            except (ArithmeticError, TypeError, ValueError, KeyError, AttributeError, RecursionError) as exc:
                # damaged input in one rank's file: the other ranks are still worth having
                print(for_terminal(f"ddpdoctor: note: rank {r}: part of its timeline was skipped "
                                   f"({type(exc).__name__}: {exc})"), file=sys.stderr)
        f.write("\n]}\n")
    os.replace(tmp, output)
    return out.count
