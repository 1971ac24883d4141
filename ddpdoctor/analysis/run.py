"""A run: the rank traces of one job, after choosing one run id and one restart attempt."""

from __future__ import annotations

import os
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

from .compact import Sharing, read_packed
from .load import RankTrace, TraceError, find_trace_files

#: Read rank files in worker processes from this many files on (2 cores here), or from this
#: many bytes of traces (a few long files: the pool costs ~0.1 s, reading 16 MB ~0.4 s a core).
PARALLEL_FROM = 16
PARALLEL_BYTES = 16 << 20


@dataclass
class Run:
    ranks: dict[int, RankTrace]
    world: int
    run_id: str
    attempt: int
    notes: list[str] = field(default_factory=list)  # input problems, one line each
    paths: list[str] = field(default_factory=list)

    @property
    def missing(self) -> list[int]:
        return [r for r in range(self.world) if r not in self.ranks]

    @property
    def backend(self) -> str:
        for rt in self.ranks.values():
            return str(rt.header.get("backend", "?"))
        return "?"

    def group_members(self, group: str) -> list[int]:
        if group == "0":
            return list(range(self.world))
        for rt in self.ranks.values():
            members = rt.header.get("_groups", {}).get(group)
            if members is not None:
                return list(members)
        return sorted(r for r, rt in self.ranks.items() if group in rt.groups)

    def duration_s(self) -> float:
        return max((rt.last_ts for rt in self.ranks.values()), default=0) / 1e6


def _num(v) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return 0.0


def _header_ok(rt: RankTrace, notes: list[str]) -> bool:
    """A header whose rank/world/attempt are numbers (anything else is not one of our files)."""
    try:
        ok = rt.rank >= 0 and rt.world >= 0 and rt.attempt >= 0
    except (TypeError, ValueError):
        ok = False
    if not ok:
        notes.append(f"{os.path.basename(rt.path)}: header without a valid rank/world; file ignored")
    return ok


def _total_bytes(files: list[str]) -> int:
    n = 0
    for f in files:
        try:
            n += os.path.getsize(f)
        except OSError:
            pass
    return n


def _read_all(files: list[str], jobs: int | None, sharing: Sharing) -> list[RankTrace]:
    """Every file read and packed (compact.py); values equal across ranks shared as each arrives,
    so only one rank's unshared summary is held at a time."""
    if (jobs or os.cpu_count() or 1) > 1 and len(files) > 1 and (
            len(files) >= PARALLEL_FROM or _total_bytes(files) >= PARALLEL_BYTES):
        with ProcessPoolExecutor(max_workers=jobs or min(os.cpu_count() or 1, 8)) as pool:
            # small chunks: a chunk's summaries arrive together, before they are shared
            chunk = max(1, min(8, len(files) // 32))
            return [sharing.rank(rt) for rt in pool.map(read_packed, files, chunksize=chunk)]
    return [sharing.rank(read_packed(f)) for f in files]


def load_run(paths: list[str], run_id: str | None = None, jobs: int | None = None) -> Run:
    from . import frmodel

    for p in paths:
        if not os.path.exists(p):
            raise TraceError(f"no such file or folder: {p}")
    dumps = frmodel.find_dumps(paths)  # Flight Recorder dumps among the inputs (by content)
    sources = {src for src, _kind in dumps}
    try:
        files = [f for f in find_trace_files(paths) if os.path.abspath(f) not in sources]
    except TraceError:
        if not dumps:
            raise
        files = []
    fr = None
    notes: list[str] = []
    sharing = Sharing()  # one table for the whole run (compact.py)
    if dumps and (run_id == frmodel.RUN_ID or not files):
        fr = frmodel.prepare(paths, jobs, found=dumps, sharing=sharing)
        if fr is None or not (fr.files or fr.traces):
            raise TraceError(f"no ddpdoctor trace or usable Flight Recorder dump in {', '.join(paths)}"
                             + ("; " + "; ".join(fr.notes[:2]) if fr is not None and fr.notes else ""))
        files = [] if run_id == frmodel.RUN_ID else files
        notes.extend(fr.notes)
    elif dumps:  # ddpdoctor traces say more than FR dumps of the same job: they win
        notes.append(f"{len(dumps)} Flight Recorder dump(s) next to the ddpdoctor traces: reporting the "
                     f"traces (the dumps with --run {frmodel.RUN_ID})")
    files += fr.files if fr is not None else []
    traces = _read_all(files, jobs, sharing) + (fr.traces if fr is not None else [])
    if fr is not None:
        fr.annotate(traces)
    for rt in traces:
        notes.extend(rt.problems)
    traces = [rt for rt in traces if rt.header and _header_ok(rt, notes)]
    if not traces:
        raise TraceError(f"no readable ddpdoctor trace among {len(files)} file(s): " + "; ".join(notes[:2]))
    runs = Counter(rt.run for rt in traces)
    if run_id is None:
        if len(runs) > 1:
            # The newest run (by start time) wins; the others are named so they can be chosen.
            newest = max(traces, key=lambda rt: _num(rt.header.get("wall0")))
            run_id = newest.run
            others = ", ".join(f"{r} ({n} files)" for r, n in runs.items() if r != run_id)
            notes.append(f"the folder holds {len(runs)} runs; reporting run {run_id}, "
                         f"ignoring {others} (choose with --run)")
        else:
            run_id = next(iter(runs))
    elif run_id not in runs:
        raise TraceError(f"run {run_id} not found; runs here: {', '.join(runs)}")
    traces = [rt for rt in traces if rt.run == run_id]
    attempt = max(rt.attempt for rt in traces)
    if any(rt.attempt != attempt for rt in traces):
        notes.append(f"torchrun restarted this job; reporting the last attempt ({attempt})")
        traces = [rt for rt in traces if rt.attempt == attempt]
    ranks: dict[int, RankTrace] = {}
    for rt in traces:
        if rt.rank in ranks:
            notes.append(f"two files for rank {rt.rank} in the same attempt; using "
                         f"{os.path.basename(rt.path)}")
        ranks[rt.rank] = rt
    world = max(max((rt.world for rt in traces), default=0), max(ranks) + 1)
    run = Run(ranks=dict(sorted(ranks.items())), world=world, run_id=run_id, attempt=attempt,
              notes=notes, paths=list(paths))
    if run.missing:
        from ..trace.ranges import fmt_ranks

        what = "Flight Recorder dump" if run_id == frmodel.RUN_ID else "trace"
        notes.append(f"no {what} for rank(s) {fmt_ranks(run.missing)} of {world}: "
                     "the report covers the ranks found")
    return run
