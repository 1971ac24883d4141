"""Helpers of the timeline tests: run ``ddpdoctor timeline`` and check its output against the
Chrome Trace Event format's rules (strict JSON, well-nested slices per lane)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from support.jobs import ROOT


def run_timeline(trace_dir, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ddpdoctor", "timeline", str(trace_dir), "-o", str(out),
                           *extra], capture_output=True, text=True, timeout=120, cwd=str(ROOT))


def _strict_load(path: Path) -> dict:
    def no_constants(name):
        raise AssertionError(f"non-standard JSON constant {name} in {path}")

    with open(path, encoding="utf-8") as f:
        return json.load(f, parse_constant=no_constants)


def check_format(doc: dict) -> list[dict]:
    """The rules of the Trace Event format that viewers rely on; returns the events."""
    assert isinstance(doc, dict) and isinstance(doc.get("traceEvents"), list)
    assert doc.get("displayTimeUnit") in ("ms", "ns")
    events = doc["traceEvents"]
    named: dict[int, str] = {}
    sorted_pids = set()
    for ev in events:
        for key in ("ph", "pid", "tid", "ts", "name"):
            assert key in ev, f"{key} missing in {ev}"
        assert isinstance(ev["pid"], int) and ev["pid"] > 0, ev  # pid 0 is special to viewers
        assert isinstance(ev["tid"], int) and ev["tid"] > 0, ev
        assert isinstance(ev["ts"], (int, float)) and ev["ts"] >= 0, ev
        ph = ev["ph"]
        assert ph in ("X", "i", "M"), ev
        if ph == "X":
            assert isinstance(ev.get("dur"), (int, float)) and ev["dur"] >= 0, ev
            assert isinstance(ev.get("args"), dict) and ev["args"], ev
        elif ph == "i":
            assert ev.get("s") in ("t", "p", "g"), ev
            assert isinstance(ev.get("args"), dict), ev
        else:
            assert isinstance(ev.get("args"), dict), ev
            if ev["name"] == "process_name":
                named[ev["pid"]] = ev["args"]["name"]
            elif ev["name"] == "process_sort_index":
                sorted_pids.add(ev["pid"])
            elif ev["name"] in ("thread_name", "thread_sort_index"):
                pass
            else:
                raise AssertionError(f"unexpected metadata event {ev}")
    used = {ev["pid"] for ev in events}
    assert used == set(named), f"processes without a name: {used - set(named)}"
    assert used == sorted_pids
    # tids are unique across processes (viewers key threads by tid alone).
    owner: dict[int, int] = {}
    for ev in events:
        assert owner.setdefault(ev["tid"], ev["pid"]) == ev["pid"], f"tid {ev['tid']} in two processes"
    assert_nested(events)
    return events


def assert_nested(events: list[dict]) -> None:
    """Complete events of one thread must nest or be disjoint, or viewers drop/misdraw them."""
    by_tid: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for ev in events:
        if ev["ph"] == "X":
            by_tid[ev["tid"]].append((ev["ts"], ev["ts"] + ev["dur"]))
    for tid, ivs in by_tid.items():
        ivs.sort(key=lambda iv: (iv[0], -iv[1]))
        stack: list[int] = []
        for s, e in ivs:
            while stack and stack[-1] <= s:
                stack.pop()
            assert not stack or e <= stack[-1], f"tid {tid}: slice {s}-{e} overlaps its neighbour's end {stack[-1]}"
            stack.append(e)


def process_of(events: list[dict], rank: int) -> int:
    for ev in events:
        if ev["ph"] == "M" and ev["name"] == "process_name" and ev["args"]["name"].startswith(f"rank {rank} ("):
            return ev["pid"]
    raise AssertionError(f"no process for rank {rank}")


