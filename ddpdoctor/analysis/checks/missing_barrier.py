"""missing-barrier: a file written by one rank and read, removed or overwritten by another with no
collective between them.

Decided by happens-before from the collectives, never from timing. Each ``file`` record carries
``pos`` (sequence events the rank had issued per group) and, where some were still in flight,
``done`` (events completed). Operation X on rank P happens before Y on rank Q if some group g
with both as members has ``completed_Q(Y)[g] > issued_P(X)[g]``: P entered collective
``issued+1`` after X, and Q had finished it before Y. Neither direction -> concurrent.
"""

from __future__ import annotations

import bisect
import fnmatch
import os
from collections import defaultdict
from dataclasses import dataclass

from ..findings import Location
from .base import Check, Context, Kind, fmt

#: Lock files (the ``filelock`` convention): ranks that open the same one before touching a
#: path synchronise through it, which the collectives cannot show.
_LOCK_SUFFIXES = (".lock", ".lck")
#: Examples kept per finding.
_EXAMPLES = 3


@dataclass
class Access:
    rank: int
    kind: str  # w | r | rm | mkdir
    path: str
    pos: dict
    done: dict
    site: object
    ts: int
    how: str = ""  # "rename" (the path is the target of a rename), "append", "dir" (dir removed)
    host: str = ""
    local: bool = False  # on a machine-local filesystem

    def same_file(self, other: Access) -> bool:
        """The same path on two hosts is one file only on a shared (network) filesystem."""
        return self.host == other.host or not (self.local or other.local)

    def completed(self, g: str) -> int:
        return int(self.done.get(g, self.pos.get(g, 0)))


class _Order:
    """Happens-before between file accesses of different ranks, from group positions."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self._members: dict[str, frozenset] = {}

    def member(self, rank: int, g: str) -> bool:
        m = self._members.get(g)
        if m is None:
            m = self._members[g] = frozenset(self.ctx.run.group_members(g))
        return rank in m

    def before(self, x: Access, y: Access) -> str | None:
        """Group in which x happens before y, or None."""
        for g in y.pos:
            c = y.completed(g)
            if c > int(x.pos.get(g, 0)) and self.member(x.rank, g) and self.member(y.rank, g):
                return g
        return None

    def ordered(self, x: Access, y: Access) -> bool:
        return self.before(x, y) is not None or self.before(y, x) is not None


class _Near:
    """Accesses indexed by their position in the world group, which every rank belongs to: two
    accesses can only be concurrent if their world intervals [completed, issued] overlap, so
    candidates come from a few buckets instead of every pair (hundreds of ranks, many epochs)."""

    SPAN = 64  # longest interval indexed (a long-unwaited async op); beyond it: fewer candidates

    def __init__(self, accs: list[Access]) -> None:
        self.buckets: dict[int, list[Access]] = defaultdict(list)
        for a in accs:
            for v in self._values(a):
                self.buckets[v].append(a)

    def _values(self, a: Access) -> range:
        hi = int(a.pos.get("0", 0))
        return range(max(a.completed("0"), hi - self.SPAN), hi + 1)

    def candidates(self, a: Access) -> list[Access]:
        vals = self._values(a)
        if len(vals) == 1:
            return self.buckets.get(vals[0], [])
        out: dict[int, Access] = {}
        for v in vals:
            for b in self.buckets.get(v, ()):
                out[id(b)] = b
        return list(out.values())


def _modified(ctx: Context) -> tuple[set, set]:
    """Paths some rank writes or removes, and paths removed (maybe directories)."""
    modified: set = set()
    removed: set = set()
    for rt in ctx.run.ranks.values():
        for r in rt.records("file"):
            op = r.get("op")
            if op in ("w", "rm", "mv"):
                modified.add(r.get("path"))
                if op != "w":
                    removed.add(r.get("path"))
                if op == "mv":
                    modified.add(r.get("to"))
    return modified, removed


def _relevant(path: str, modified: set, removed: set) -> bool:
    if path in modified:
        return True
    d = os.path.dirname(path)
    while d and d != os.path.dirname(d):
        if d in removed:
            return True
        d = os.path.dirname(d)
    return False


def _accesses(ctx: Context) -> tuple[dict[str, list[Access]], dict[int, list[tuple[int, str]]]]:
    """File accesses by path, keeping only paths that some rank modifies (read-only data, the
    bulk of the records on large jobs, cannot race)."""
    by_path: dict[str, list[Access]] = defaultdict(list)
    locks: dict[int, list[tuple[int, str]]] = defaultdict(list)  # rank -> [(ts, lock path)]
    modified, removed = _modified(ctx)
    if not modified:
        return by_path, locks
    relevant: dict[str, bool] = {}
    by_dir: dict[str, list[str]] = defaultdict(list)  # directory -> modified paths in it
    for m in modified:
        if isinstance(m, str):
            by_dir[os.path.dirname(m)].append(m)
    for rank, rt in ctx.run.ranks.items():
        seen: set = set()
        host = str(rt.header.get("host", ""))
        for r in rt.records("file"):
            op, path = r.get("op"), r.get("path")
            if not isinstance(path, str):
                continue
            pos = r.get("pos") or {}
            done = r.get("done") or {}
            ts = int(r.get("ts", 0) or 0)
            if path.endswith(_LOCK_SUFFIXES):
                locks[rank].append((ts, path))
                continue
            items: list[tuple[str, str, str]] = []
            if op == "mv":
                items.append(("rm", path, ""))
                to = r.get("to")
                if isinstance(to, str):
                    items.append(("w", to, "rename"))
            elif op == "r" and r.get("probe"):
                items.extend(_probed(r, path, modified, by_dir))
            elif op in ("w", "r", "rm", "mkdir"):
                items.append((op, path, "append" if r.get("app") else ""))
            for kind, p, how in items:
                keep = relevant.get(p)
                if keep is None:
                    keep = relevant[p] = _relevant(p, modified, removed)
                if not keep:
                    continue
                key = (kind, p, how, tuple(sorted(pos.items())), tuple(sorted(done.items())))
                if key in seen:
                    continue  # the same operation again between the same collectives
                seen.add(key)
                by_path[p].append(Access(rank, kind, p, pos, done, r.get("site"), ts, how, host,
                                         bool(r.get("loc"))))
    for rank in locks:
        locks[rank].sort()
    return by_path, locks


def _probed(r: dict, path: str, modified: set, by_dir: dict[str, list[str]]) -> list[tuple[str, str, str]]:
    """An existence check (stat), a directory listing or a glob is a read of every modified path
    it can see: the path itself, the files in the directory, the paths the pattern matches."""
    probe = r.get("probe")
    if probe == "stat":
        return [("r", path, "probe-miss" if r.get("miss") else "probe")]
    if probe == "listdir":
        return [("r", p, "listing") for p in by_dir.get(path.rstrip(os.sep) or os.sep, ())]
    if probe == "glob":
        return [("r", p, "glob") for p in modified if isinstance(p, str) and fnmatch.fnmatchcase(p, path)]
    return [("r", path, "")]


def _add_directory_removals(by_path: dict[str, list[Access]]) -> None:
    """Removing a directory (rmtree, rmdir) removes every path under it."""
    paths = sorted(by_path)
    for d in paths:
        removals = [a for a in by_path[d] if a.kind == "rm" and a.how != "dir"]
        if not removals:
            continue
        prefix = d.rstrip(os.sep) + os.sep
        i = bisect.bisect_left(paths, prefix)
        while i < len(paths) and paths[i].startswith(prefix):
            if any(a.rank != rm.rank for a in by_path[paths[i]] for rm in removals):
                by_path[paths[i]].extend(Access(rm.rank, "rm", paths[i], rm.pos, rm.done, rm.site,
                                                rm.ts, "dir", rm.host, rm.local) for rm in removals)
            i += 1


def _locked(locks: dict[int, list[tuple[int, str]]], x: Access, y: Access) -> bool:
    """Both ranks opened the same lock file before their access (a file-lock protocol)."""
    lx = {p for ts, p in locks.get(x.rank, ()) if ts <= x.ts}
    if not lx:
        return False
    return any(p in lx for ts, p in locks.get(y.rank, ()) if ts <= y.ts)


_VERB = {"w": "writes", "r": "reads", "rm": "removes", "mkdir": "creates"}


def _reader_failed(ctx: Context, readers: list[int], y: Access) -> str:
    """The readers that then raised: their failure is this race's consequence, not its cause."""
    failed = []
    for r in readers:
        rt = ctx.run.ranks.get(r)
        ex = (rt.exit_record() if rt is not None else None) or {}
        if ex.get("how") == "exception" and int(ex.get("ts", 0) or 0) >= y.ts:
            failed.append((r, str(ex.get("exc", ""))[:120], ex.get("line")))
    if not failed:
        return ""
    r, exc, line = failed[0]
    at = f" at line {line}" if line else ""
    return (f" {fmt([f[0] for f in failed])} then failed ({exc}{at}): the missing barrier is the root "
            "cause of that failure.")


_PROBE_VERB = {"probe": "checks whether it exists", "probe-miss": "checks whether it exists (it did not yet)",
               "listing": "lists the directory holding it", "glob": "globs a pattern matching it"}


def _verb(a: Access) -> str:
    if a.how in _PROBE_VERB:
        return _PROBE_VERB[a.how]
    if a.how == "rename":
        return "renames a file onto"
    if a.how == "dir":
        return "removes the directory holding"
    if a.how == "append":
        return "appends to"
    return _VERB.get(a.kind, a.kind)


class MissingBarrier(Check):
    id = "DD003"
    category = "missing-barrier"
    severity = "error"
    title = "File shared between ranks with no collective between write and use"
    fix = ("Order the file operations with a collective: write on one rank, then dist.barrier() on "
           "all ranks, then read (`if rank == 0: torch.save(...)`, `dist.barrier()`, "
           "`torch.load(...)`). Let one rank write a shared path, or give each rank its own file name.")
    kinds = {"multi-write": Kind(
        severity="warning", title="Several ranks write the same file concurrently",
        fix=("Write shared files from one rank (`if dist.get_rank() == 0:`) followed by "
             "dist.barrier(), or use a per-rank file name."))}

    def run(self, ctx: Context):
        self._checks: dict[tuple, Access] = {}  # race key -> an existence check by the reader
        by_path, locks = _accesses(ctx)
        if not by_path:
            return []
        _add_directory_removals(by_path)
        order = _Order(ctx)
        races: dict[tuple, list] = {}  # (writer site key, reader site key) -> [(x, y, path)]
        writes: dict[tuple, list] = {}
        for path, accs in by_path.items():
            if len({a.rank for a in accs}) < 2:
                continue
            mods = [a for a in accs if a.kind in ("w", "rm")]
            if not mods:
                continue
            reads = [a for a in accs if a.kind == "r"]
            self._pairs(ctx, order, locks, path, mods, reads, races)
            self._multi_writers(ctx, order, locks, path, mods + [a for a in accs if a.kind == "mkdir"],
                                writes)
        findings = [self._race_finding(ctx, order, pairs, self._checks.get(k)) for k, pairs in races.items()]
        findings += [self._writers_finding(ctx, order, pairs) for pairs in writes.values()]
        return findings

    # -- detection ------------------------------------------------------------------------------
    @staticmethod
    def _site_key(ctx: Context, a: Access) -> tuple:
        s = ctx.site(a.rank, a.site)
        return (s.get("file"), s.get("line"))

    def _pairs(self, ctx, order, locks, path, mods, reads, out) -> None:
        """Modifications and reads on different ranks that no collective orders."""
        readers_hit: dict[int, tuple] = {}
        near = _Near(mods)
        # A rank that polls for the file and then loads it: the load is the read to report, the
        # existence check a location of the same finding.
        for y in sorted(reads, key=lambda a: a.how in _PROBE_VERB):
            if y.rank in readers_hit:
                if y.how in _PROBE_VERB:
                    k = readers_hit[y.rank]
                    x0 = out[k][-1][0]
                    if x0.same_file(y) and not order.ordered(x0, y):
                        self._checks.setdefault(k, y)
                continue
            for x in near.candidates(y):
                if x.rank == y.rank or not x.same_file(y) or order.ordered(x, y) or _locked(locks, x, y):
                    continue
                key = (self._site_key(ctx, x), self._site_key(ctx, y), x.kind)
                out.setdefault(key, []).append((x, y, path))
                readers_hit[y.rank] = key
                break

    def _multi_writers(self, ctx, order, locks, path, mods, out) -> None:
        """Different ranks modifying the same path with no collective between them."""
        first = None
        involved: set = set()
        near = _Near(mods)
        for x in mods:
            if x.rank in involved and first is not None:
                continue
            for y in near.candidates(x):
                if y.rank == x.rank or not x.same_file(y) or not self._conflict(x, y):
                    continue
                if order.ordered(x, y) or _locked(locks, x, y):
                    continue
                involved.update((x.rank, y.rank))
                first = first or (x, y)
                break
        if first is not None:
            x, y = first
            key = (self._site_key(ctx, x), self._site_key(ctx, y))
            out.setdefault(key, []).append((x, y, path, involved))

    @staticmethod
    def _conflict(x: Access, y: Access) -> bool:
        if x.kind == "mkdir" or y.kind == "mkdir":
            # makedirs(exist_ok=True) on every rank is fine; creating what another removes is not
            return "rm" in (x.kind, y.kind) and x.kind != y.kind
        return not (x.how == "append" and y.how == "append")  # O_APPEND writes do not clobber

    # -- reporting ------------------------------------------------------------------------------
    @staticmethod
    def _between(order: _Order, x: Access, y: Access) -> str:
        """Where a barrier would order x before y, in words."""
        common = [g for g in sorted(set(x.pos) | set(y.pos) | {"0"})
                  if order.member(x.rank, g) and order.member(y.rank, g)]
        if not common:
            return "the two ranks share no process group"
        g = "0" if "0" in common else common[0]
        nx, ny = int(x.pos.get(g, 0)), y.completed(g)
        return (f"in group {g}, rank {x.rank} had issued {nx} collective(s) when it "
                f"{'wrote' if x.kind == 'w' else 'removed'} the file and rank {y.rank} had completed "
                f"{ny} when it {'read' if y.kind == 'r' else 'touched'} it, so no collective separates them")

    def _race_finding(self, ctx: Context, order: _Order, pairs: list, check: Access | None = None):
        x, y, path = pairs[0]
        paths = sorted({p for _, _, p in pairs})
        writers = sorted({a.rank for a, _, _ in pairs})
        readers = sorted({b.rank for _, b, _ in pairs})
        more = f" (and {len(paths) - 1} more path(s) from the same lines, e.g. " \
               f"{', '.join(paths[1:1 + _EXAMPLES - 1])})" if len(paths) > 1 else ""
        consequence = ("it may read a partially written file, the previous version, or find none"
                       if x.kind == "w" else "the file may already be gone when it is read")
        if x.how == "rename":
            consequence = "the rename is atomic, but whether the reader gets the new or the old file is timing"
        if y.how in _PROBE_VERB:
            consequence = ("whether the file is there yet is timing: a rank that finds it missing skips, "
                           "waits or fails, one that finds it may read it half written")
            if y.how == "probe-miss" and x.kind == "w":
                consequence = ("this time it did not exist yet, so the rank went on as if it were never "
                               "written (a failure there is a consequence of this race)")
        reads = "reads it" if len(readers) == 1 else "read it"
        if y.how in _PROBE_VERB:
            reads = _verb(y)
        msg = (f"{fmt(writers)} {_verb(x)} {path}{more} at {ctx.where(x.rank, x.site)} and "
               f"{fmt(readers)} {reads} at {ctx.where(y.rank, y.site)} "
               f"with no collective between them ({self._between(order, x, y)}). Which happens first "
               f"is a matter of timing, even if it worked this time: {consequence}.")
        if check is not None:
            msg += (f" Rank {check.rank} {_verb(check)} at {ctx.where(check.rank, check.site)} first: "
                    "an existence check is no synchronisation (the file appears when writing starts).")
        msg += _reader_failed(ctx, readers, y)
        locs = [self._loc(ctx, x, "write"), self._loc(ctx, y, "read")]
        if check is not None:
            locs.append(self._loc(ctx, check, "check"))
        evidence = [[fmt([a.rank]), f"{a.kind} {a.path} at pos {a.pos}", ctx.where(a.rank, a.site)]
                    for a in (x, y)]
        return self.finding(msg, writers + readers, locs, evidence=evidence,
                            data={"path": path, "paths": paths[:20], "count": len(paths),
                                  "writers": writers, "readers": readers, "op": x.kind})

    def _writers_finding(self, ctx: Context, order: _Order, pairs: list):
        x, y, path, _ = pairs[0]
        paths = sorted({p[2] for p in pairs})
        ranks = sorted({r for p in pairs for r in p[3]})
        more = f" (and {len(paths) - 1} more path(s) from the same lines)" if len(paths) > 1 else ""
        msg = (f"{fmt(ranks)} modify {path}{more} with no collective between them: rank {x.rank} "
               f"{_verb(x)} it at {ctx.where(x.rank, x.site)}, rank {y.rank} {_verb(y)} it at "
               f"{ctx.where(y.rank, y.site)}. The last one wins by timing; concurrent writes can "
               f"interleave into a corrupt file, and a remove can fail on the rank that comes second.")
        locs = [self._loc(ctx, x, "write"), self._loc(ctx, y, "write")]
        return self.finding(msg, ranks, locs, kind="multi-write",
                            data={"path": path, "paths": paths[:20], "count": len(paths), "op": "multi-write"})

    @staticmethod
    def _loc(ctx: Context, a: Access, role: str) -> Location:
        return ctx.loc(a.rank, a.site, role)
