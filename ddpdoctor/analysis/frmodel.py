"""Flight Recorder dumps as a run: each rank's dump becomes a ddpdoctor trace (schema 1).

The dumps are converted once, one streaming pass per dump (in worker processes from 16 dumps
on), into JSON Lines traces in a private temporary folder, removed at exit. Everything after that
(loading, alignment, checks, hang reconstruction, timeline, HTML) is the existing path: a rank
file is re-read only where ranks differ, so memory stays flat in the number of ranks.

The conversion of one dump is in ``frconvert``.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

from ..trace.files import PREFIX, SUFFIX
from . import frdump
from .compact import Sharing, pack
from .frconvert import C_LINE, FR_TAIL, NO_STACK, PARALLEL_FROM, RUN_ID, convert  # noqa: F401 - the API


@dataclass
class FrInput:
    """The Flight Recorder dumps among the inputs, converted."""

    traces: list = field(default_factory=list)  # RankTraces built while converting
    files: list[str] = field(default_factory=list)  # converted files to read (rewritten to a window)
    sources: set[str] = field(default_factory=set)  # every dump file recognised (absolute paths)
    notes: list[str] = field(default_factory=list)
    bases: dict[str, int] = field(default_factory=dict)  # group -> positions before the window
    by_out: dict[str, int] = field(default_factory=dict)  # converted file -> rank

    def annotate(self, traces) -> None:
        """Give every converted rank the common window (``fr_base``) of each group."""
        bases = dict(self.bases)  # one dict for all ranks: it is only read
        for rt in traces:
            if rt.path in self.by_out:
                rt.header["fr_base"] = bases


_TMP: list[str] = []


def _tmpdir() -> str:
    if not _TMP:
        d = tempfile.mkdtemp(prefix="ddpdoctor-fr-")
        _TMP.append(d)
        atexit.register(shutil.rmtree, d, True)
    return _TMP[0]


def _ours(name: str) -> bool:
    """Files of ddpdoctor's trace folders, never dumps."""
    return (name.startswith(PREFIX) and (name.endswith(SUFFIX) or name.endswith(".stacks.txt")
                                         or name.endswith(".inflight"))) or name.startswith("hang-") \
        or name == "HANG_KILL" or name.endswith(".part")


def _convert_packed(job: tuple[str, str, str]) -> dict:
    """``convert`` with its RankTrace packed (compact.pack) before it leaves the worker."""
    s = convert(job)
    if s.get("trace") is not None:
        pack(s["trace"])
    return s


def _chunk(n: int, workers: int) -> int:
    """Dumps per task: a chunk's summaries arrive together, unshared, so keep chunks small."""
    return max(1, min(8, n // (4 * workers)))


def _share(s: dict, sharing: Sharing) -> dict:
    rt = s.get("trace")
    if rt is not None:
        sharing.rank(rt)  # ranks share their call sites and more: one copy of each for the run
    return s


def find_dumps(paths: list[str]) -> list[tuple[str, str]]:
    """(path, "pickle"|"json") of every file among ``paths`` (folders walked) that looks like a dump."""
    out = []
    for p in paths:
        if os.path.isfile(p):
            kind = frdump.sniff(p)
            if kind:
                out.append((os.path.abspath(p), kind))
            continue
        if not os.path.isdir(p):
            continue
        for root, _dirs, names in os.walk(p):
            for n in sorted(names):
                if _ours(n):
                    continue
                full = os.path.join(root, n)
                kind = frdump.sniff(full)
                if kind:
                    out.append((os.path.abspath(full), kind))
    return out


def prepare(paths: list[str], jobs: int | None = None, found: list | None = None,
            sharing: Sharing | None = None) -> FrInput | None:
    """Find (unless ``found``) and convert the Flight Recorder dumps among ``paths``; None when
    there are none. Raises frdump.DumpRefused (a TraceError) for a pickle that would run code.
    Each converted rank's summary is shared (compact.Sharing) as it arrives, so that the ranks'
    summaries never all exist unshared at once."""
    found = find_dumps(paths) if found is None else found
    if not found:
        return None
    tmp = _tmpdir()
    jobs_list = [(src, kind, os.path.join(tmp, f"{PREFIX}-fr-{i:06d}{SUFFIX}"))
                 for i, (src, kind) in enumerate(found)]
    workers = jobs or min(os.cpu_count() or 1, 8)
    sharing = sharing or Sharing()
    if workers > 1 and len(jobs_list) >= PARALLEL_FROM:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            summaries = [_share(s, sharing) for s in
                         pool.map(_convert_packed, jobs_list, chunksize=_chunk(len(jobs_list), workers))]
    else:
        summaries = [_share(_convert_packed(j), sharing) for j in jobs_list]
    fr = FrInput()
    for s in summaries:
        if s.get("refused"):
            raise frdump.DumpRefused(s["refused"])
    by_rank: dict[int, dict] = {}
    skipped = 0
    for s in summaries:
        fr.notes.extend(s["notes"])
        if s.get("skip"):
            skipped += 1
            continue
        fr.sources.add(s["src"])
        prev = by_rank.get(s["rank"])
        if prev is not None:
            keep, drop = (s, prev) if s["entries"] > prev["entries"] else (prev, s)
            fr.notes.append(f"two Flight Recorder dumps for rank {s['rank']}: using "
                            f"{os.path.basename(keep['src'])} ({keep['entries']} entries), ignoring "
                            f"{os.path.basename(drop['src'])}")
            by_rank[s["rank"]] = keep
        else:
            by_rank[s["rank"]] = s
    if not by_rank:
        fr.sources.update(s["src"] for s in summaries)
        return fr if fr.notes else None
    _window(fr, by_rank)
    for r, s in sorted(by_rank.items()):
        if s.get("trace") is not None:
            fr.traces.append(s.pop("trace"))
        else:
            fr.files.append(s["out"])
        fr.by_out[s["out"]] = r
    forms = sorted({s["form"] for s in by_rank.values()})
    fr.notes.insert(0, f"read {len(by_rank)} Flight Recorder dump(s) ({'/'.join(forms)}); findings "
                       "come from PyTorch's ring buffer of collectives, not from a ddpdoctor trace")
    nostack = sorted(r for r, s in by_rank.items() if not s["stacks"] and s["entries"])
    if nostack:
        from ..trace.ranges import fmt_ranks

        fr.notes.append(f"the dumps of rank(s) {fmt_ranks(nostack)} hold no Python stacks (JSON form, or "
                        "recorded with stack traces off): no call site, line or condition for their calls")
    return fr


def _window(fr: FrInput, by_rank: dict[int, dict]) -> None:
    """Compare each group from the first position every dump still holds: drop older entries
    from the dumps that reach further back (rewriting their converted files), and say so."""
    firsts: dict[str, dict[int, int]] = {}
    for r, s in by_rank.items():
        for g, (lo, _hi, _n) in s["groups"].items():
            firsts.setdefault(g, {})[r] = lo
    cut: dict[str, int] = {}
    for g, los in firsts.items():
        common = max(los.values())
        fr.bases[g] = common - 1
        if common > 1:
            from ..trace.ranges import fmt_ranks

            starts: dict[int, list[int]] = {}
            for r, lo in los.items():
                starts.setdefault(lo, []).append(r)
            held = ", ".join(f"rank{'s' if len(rs) > 1 else ''} {fmt_ranks(rs)} from #{lo}"
                             for lo, rs in sorted(starts.items(), reverse=True))
            fr.notes.append(f"process group {g}: the ring buffers wrapped (TORCH_FR_BUFFER_SIZE) and hold "
                            f"{held}; compared from #{common}, earlier collectives are missing from at "
                            "least one dump")
        if any(lo < common for lo in los.values()):
            cut[g] = common
    if not cut:
        return
    for s in by_rank.values():
        mine = {g: c for g, c in cut.items() if g in s["groups"] and s["groups"][g][0] < c}
        if mine:
            _rewrite(s["out"], mine)
            s["trace"] = None  # its blocks moved: read again by load.read_rank


def _rewrite(path: str, cut: dict[str, int]) -> None:
    keys = {json.dumps(g, separators=(",", ":")).encode(): c for g, c in cut.items()}
    tmp = path + ".tmp"
    with open(path, "rb") as src, open(tmp, "wb") as dst:
        for raw in src:
            m = C_LINE.match(raw)
            if m is not None:
                c = keys.get(m.group(1))
                if c is not None and int(m.group(2)) < c:
                    continue
            dst.write(raw)
    os.replace(tmp, path)


def block_offsets(rt, group: str, b: int):
    """The byte offsets of ``group``'s events in digest block ``b`` of a converted rank, from the
    block's start (an ``array``), when the converter indexed that block (the last one of each
    group, where a hang shows); None otherwise (ddpdoctor traces, a file rewritten by _window)."""
    got = getattr(rt, "last_block", None)
    if got:
        lb = got.get(group)
        if lb is not None and lb[0] == b:
            return lb[1]
    return None


def is_fr(run) -> bool:
    """Whether the run was read from Flight Recorder dumps."""
    return any(rt.header.get("source") == "flight-recorder" for rt in run.ranks.values())


def base(run, group: str) -> int:
    """Collectives of ``group`` before the compared window (0 for ddpdoctor traces)."""
    for rt in run.ranks.values():
        b = rt.header.get("fr_base")
        if b:
            return int(b.get(group, 0) or 0)
        return 0
    return 0


def limits_text(run) -> str:
    """What findings from FR dumps cannot show."""
    parts = ["reduce ops, roots and object collectives are not in FR dumps",
             "DDP steps, file operations, seeds and how ranks exited are not recorded"]
    if any(not (rt.header.get("fr") or {}).get("stacks", True) for rt in run.ranks.values()):
        parts.insert(0, "some dumps have no stacks, so those calls have no call site")
    return "; ".join(parts)



def annotate_findings(run, findings) -> None:
    """Say on every finding that it comes from FR dumps, and what those cannot show."""
    limits = limits_text(run)
    for f in findings:
        f.message += f" (From Flight Recorder dumps; {limits}.)"
        f.data["source"] = "flight-recorder"
