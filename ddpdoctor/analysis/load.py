"""Reading trace folders: one streaming pass per rank file into a compact ``RankTrace``.

Memory does not grow with events per rank: sequence events are folded into per-group block
digests (with the file offset of each block, so the aligner can re-read just the block where
ranks differ); the rare records (groups, files, seeds, samplers, exits, hangs) are kept whole.
Corrupt or truncated lines are skipped and counted, never fatal.
"""

from __future__ import annotations

import os
import zlib
from collections import deque
from dataclasses import dataclass, field

from ..errors import TraceError
from ..trace import ops
from ..trace.files import PREFIX, SCHEMA_VERSION, SUFFIX, open_regular
from .conform import (
    HEADER_TYPES,
    RARE_TYPES,
    bounded_lines,
    conform,
    conform_site,
    header_valid,
    parse_line,
    well_typed,
)
from .fastscan import ASYMMETRIC_OPS, Bulk, signature  # noqa: F401 - both re-exported
from .fastscan import Shape as _Shape
from .sidecars import read_sidecars

#: Sequence events per digest block.
BLOCK = 256
#: Last events kept per rank for the summary and failure analysis.
TAIL = 20
_RARE = frozenset({"pg", "init", "file", "file_cap", "seed", "split", "sampler", "set_epoch", "optim",
                   "rng",  # Python/NumPy draws while setting up (rank/patches/pyrng.py)
                   "ddp", "exit", "hang", "pending", "w",
                   # replica digests and what wrote a replica (rank/patches/replicas.py), BatchNorm layers
                   "replica", "replica_w", "bn",
                   # DataLoader passes: the samples each rank drew (rank/patches/coverage.py)
                   "cov",
                   # non-finite gradients and partial parameter use (rank/patches/grads.py, paramuse.py)
                   "grad_nf", "grad_used"})
#: Rare kinds that a long run can write without bound: beyond this many per kind only a count is
#: kept. How a rank ended (exit, hang, pending, init, pg) is never dropped; async waits ("w") are
#: always summarised (RankTrace.async_waits), never kept one by one.
RARE_CAP = 100000
_UNCAPPED = frozenset({"exit", "hang", "pending", "init", "pg", "file_cap"})
#: Ops counted as barriers (RankTrace.after_barrier).
BARRIER_OPS = ops.BARRIER_OPS
#: Bulk path for ``c`` records (most of a trace, see fastscan.py). False: json.loads for every
#: line (the reference the bulk path is tested against).
FAST_PATH = True
_MAX_SHAPES = 4096


@dataclass
class GroupStream:
    count: int = 0
    # per block: [op digest, signature digest, file offset of the block's first event]
    blocks: list = field(default_factory=list)
    _op: int = 0
    _sig: int = 0


@dataclass
class RankTrace:
    path: str
    header: dict = field(default_factory=dict)
    sites: dict = field(default_factory=dict)
    groups: dict = field(default_factory=dict)  # name -> GroupStream
    p2p: dict = field(default_factory=dict)  # "g:src>dst" -> [count, sig digest, first descs...]
    rare: list = field(default_factory=list)
    tail: deque = field(default_factory=lambda: deque(maxlen=TAIL))
    errors: list = field(default_factory=list)  # sequence events that raised
    overlaps: list = field(default_factory=list)  # collectives on DDP params/grads
    ddp_steps: dict = field(default_factory=lambda: {"ddp_forward": 0, "ddp_backward": 0})
    ddp_sites: dict = field(default_factory=dict)  # op -> site of last DDP step
    # DDP forwards/backwards that did not communicate ("e" records), also counted in ddp_steps
    ddp_local: dict = field(default_factory=lambda: {"ddp_forward": 0, "ddp_backward": 0})
    ddp_train_fwd: int = 0  # DDP forwards run with grad enabled (training steps)
    waits: dict = field(default_factory=dict)  # op -> [count, total µs, longest µs]
    op_sites: dict = field(default_factory=dict)  # (op, site) -> [count, total µs]
    # (barrier site, op of the next event in the barrier's group) -> count
    after_barrier: dict = field(default_factory=dict)
    last_op: dict = field(default_factory=dict)  # group -> (op, site) of its latest event
    events: int = 0
    last_ts: int = 0
    bad_lines: int = 0
    truncated: bool = False
    problems: list = field(default_factory=list)
    # async waits ("w"), summarised: op -> [count, total µs, longest µs]
    async_waits: dict = field(default_factory=dict)
    # (group, seq) of async waits that completed after the watchdog wrote them as pending
    waited: set = field(default_factory=set)
    dropped: dict = field(default_factory=dict)  # rare kind -> records beyond RARE_CAP (counted)
    # the rank's trace output failed (full disk, folder removed): its "stopped" record
    output_fault: dict | None = None

    @property
    def rank(self) -> int:
        return int(self.header.get("rank", -1))

    @property
    def run(self) -> str:
        return str(self.header.get("run", ""))

    @property
    def attempt(self) -> int:
        return int(self.header.get("attempt", 0))

    @property
    def world(self) -> int:
        return int(self.header.get("world", 0))

    def site(self, sid) -> dict:
        return self.sites.get(sid) or {"file": "?", "line": 0, "func": "?", "src": "", "stack": []}

    def exit_record(self) -> dict | None:
        for r in reversed(self.rare):
            if r.get("t") == "exit":
                return r
        return None

    def records(self, kind: str) -> list[dict]:
        return [r for r in self.rare if r.get("t") == kind]


def find_trace_files(paths: list[str]) -> list[str]:
    files: list[str] = []
    for p in paths:
        if not os.path.exists(p):
            raise TraceError(f"no such file or folder: {p}")
        if os.path.isfile(p):
            files.append(p)
            continue
        for root, _dirs, names in os.walk(p):
            files.extend(os.path.join(root, n) for n in sorted(names)
                         if n.startswith(PREFIX) and n.endswith(SUFFIX))
    if not files:
        raise TraceError(f"no ddpdoctor trace files (rank*.jsonl) in {', '.join(paths)}")
    return sorted(files)


def read_rank(path: str) -> RankTrace:
    """One streaming pass over a rank's file."""
    rt = RankTrace(path=path)
    try:
        f = open_regular(path)
    except OSError as exc:
        rt.problems.append(f"cannot read {path}: {exc.strerror or exc}")
        return rt
    loads = parse_line
    crc = zlib.crc32
    shapes: dict[tuple, _Shape | None] = {}
    bulk = Bulk(rt, shapes, BLOCK)  # reads the c lines of known shapes in between
    rare_counts: dict[str, int] = {}
    pending_waits: set = set()
    with f:
        for start, raw, key in bulk.scan(f, FAST_PATH):
            if raw is None:
                rt.bad_lines += 1  # an over-long line
                continue
            if not raw.endswith(b"\n"):
                # NUL bytes: space a mapped trace file had reserved but not yet filled when its
                # rank died (see mappedtrace); anything else: a rank killed mid-write
                rt.truncated = not raw.startswith(b"\0")
                break
            try:
                rec = loads(raw)
            except (ValueError, RecursionError):  # RecursionError: absurdly deep nesting
                rt.bad_lines += 1
                continue
            if not isinstance(rec, dict) or not well_typed(rec):
                rt.bad_lines += 1
                continue
            t = rec.get("t")
            if t == "c":
                rt.events += 1
                g = rec.get("g", "0")
                gs = rt.groups.get(g)
                if gs is None:
                    gs = rt.groups[g] = GroupStream()
                if gs.count % BLOCK == 0:
                    if gs.count:
                        gs.blocks[-1][0], gs.blocks[-1][1] = gs._op, gs._sig
                    gs.blocks.append([0, 0, start])
                    gs._op = gs._sig = 0
                op = rec.get("op", "?")
                gs._op = crc(op.encode(), gs._op)
                gs._sig = crc((op + "|" + signature(rec)).encode(), gs._sig)
                gs.count += 1
                rt.tail.append(rec)
                if "err" in rec:
                    rt.errors.append(rec)
                if "ddp_overlap" in rec:
                    rt.overlaps.append(rec)
                if op in rt.ddp_steps:
                    rt.ddp_steps[op] += 1
                    rt.ddp_sites[op] = rec.get("site")
                    if rec.get("grad") and op == "ddp_forward":
                        rt.ddp_train_fwd += 1
                d = rec.get("d", 0)
                w = rt.waits.get(op)
                if w is None:
                    rt.waits[op] = [1, d, d]
                else:
                    w[0] += 1
                    w[1] += d
                    if d > w[2]:
                        w[2] = d
                site = rec.get("site")
                w = rt.op_sites.get((op, site))
                if w is None:
                    rt.op_sites[(op, site)] = [1, d]
                else:
                    w[0] += 1
                    w[1] += d
                prev = rt.last_op.get(g)
                if prev is not None and prev[0] in BARRIER_OPS:
                    k = (prev[1], op)
                    rt.after_barrier[k] = rt.after_barrier.get(k, 0) + 1
                rt.last_op[g] = (op, site)
                end = rec.get("ts", 0) + d
                if end > rt.last_ts:
                    rt.last_ts = end
                if key is not None and key not in shapes and len(shapes) < _MAX_SHAPES:
                    shapes[key] = _Shape.make(raw, rec, gs, BARRIER_OPS)
            elif t == "p":
                rt.events += 1
                key = f'{rec.get("g", "0")}:{rec.get("ch", "?")}'
                ent = rt.p2p.get(key)
                # direction-neutral, so a send and its matching recv have the same digest
                sig = ("obj|" + str(rec.get("nobj")) if "nobj" in rec else "t|" + str(rec.get("x"))).encode()
                if ent is None:
                    rt.p2p[key] = [1, crc(sig), rec]
                else:
                    ent[0] += 1
                    ent[1] = crc(sig, ent[1])
                rt.tail.append(rec)
                if "err" in rec:
                    rt.errors.append(rec)
                end = rec.get("ts", 0) + rec.get("d", 0)
                if end > rt.last_ts:
                    rt.last_ts = end
            elif t == "site":
                if conform_site(rec):
                    rt.sites[rec.get("id")] = rec
                else:
                    rt.bad_lines += 1
            elif t == "e":
                op = rec.get("op", "?")
                if op in rt.ddp_steps:
                    rt.ddp_steps[op] += 1
                    rt.ddp_local[op] += 1
                    rt.ddp_sites[op] = rec.get("site")
                    if rec.get("grad") and op == "ddp_forward":
                        rt.ddp_train_fwd += 1
                if "err" in rec:
                    rt.errors.append(rec)
                elif op.startswith("join"):
                    rt.rare.append(rec)
            elif t == "header":
                if rt.header.get("t") == "header":
                    rt.problems.append(f"{os.path.basename(path)}: second header ignored")
                else:
                    rec.pop("_groups", None)  # the loader's own key, never the file's
                    conform(rec, HEADER_TYPES)
                    rt.header = dict(rt.header, **rec)
            elif t in _RARE:
                if t == "w":
                    op = rec.get("op", "?")
                    d = rec.get("d", 0)
                    w = rt.async_waits.get(op)
                    if w is None:
                        rt.async_waits[op] = [1, d, d]
                    else:
                        w[0] += 1
                        w[1] += d
                        if d > w[2]:
                            w[2] = d
                    k = (rec.get("g"), rec.get("s"))
                    if k in pending_waits:
                        rt.waited.add(k)
                elif t in _UNCAPPED:
                    if t in RARE_TYPES:
                        conform(rec, RARE_TYPES[t])
                        if t == "exit" and "inflight" in rec:
                            rec["inflight"] = [i for i in rec["inflight"] if isinstance(i, list) and len(i) >= 5]
                    rt.rare.append(rec)
                    if t == "pending" and str(rec.get("op", "")).endswith(".wait"):
                        pending_waits.add((rec.get("g"), rec.get("s")))
                else:
                    n = rare_counts.get(t, 0)
                    rare_counts[t] = n + 1
                    if n < RARE_CAP:
                        if t in RARE_TYPES:
                            conform(rec, RARE_TYPES[t])
                        rt.rare.append(rec)
                    else:
                        rt.dropped[t] = rt.dropped.get(t, 0) + 1
                ts = rec.get("ts")
                if isinstance(ts, int) and ts > rt.last_ts:
                    rt.last_ts = ts
                ranks = rec.get("ranks")
                if t == "pg" and isinstance(ranks, list) and all(type(r) is int for r in ranks):
                    rt.header.setdefault("_groups", {})[rec.get("g")] = ranks
            else:
                rt.bad_lines += 0  # unknown record types from newer writers are skipped
    bulk.finish()
    rt.events += bulk.n
    if bulk.end > rt.last_ts:
        rt.last_ts = bulk.end
    read_sidecars(rt, path)
    for gs in rt.groups.values():
        if gs.blocks:
            gs.blocks[-1][0], gs.blocks[-1][1] = gs._op, gs._sig
    for sh in shapes.values():
        if sh is not None and sh.n:
            w = rt.waits[sh.op]
            w[0] += sh.n
            w[1] += sh.total
            w[2] = max(w[2], sh.longest)
            w = rt.op_sites[sh.opsite]
            w[0] += sh.n
            w[1] += sh.total
    if shapes:  # the bulk path's events are raw lines: what json reads from them (fastscan.Shape)
        tail = [x if isinstance(x, dict) else loads(x) for x in rt.tail]
        rt.tail.clear()
        rt.tail.extend(tail)
    if rt.header.get("t") != "header":
        rt.header = {}  # only groups seen, no header record
    if rt.header and not header_valid(rt.header):
        rt.problems.append(f"{os.path.basename(path)}: header with a missing or invalid "
                           f"schema/run/rank/world/attempt; file ignored")
        rt.header = {}
    elif not rt.header:
        rt.problems.append(f"{os.path.basename(path)}: no header record (not a ddpdoctor trace?)")
    elif rt.header.get("schema", 0) > SCHEMA_VERSION:
        rt.problems.append(f"{os.path.basename(path)}: written by a newer ddpdoctor "
                           f"(schema {rt.header.get('schema')}); some records may be ignored")
    for kind, n in rt.dropped.items():
        rt.problems.append(f"{os.path.basename(path)}: {n} '{kind}' record(s) beyond the first "
                           f"{RARE_CAP} only counted")
    if rt.bad_lines:
        rt.problems.append(f"{os.path.basename(path)}: {rt.bad_lines} corrupt line(s) skipped")
    if rt.output_fault is not None:
        rt.problems.append(f"{os.path.basename(path)}: the trace stops early: it could not be "
                           f"written ({rt.output_fault.get('why')}); the rank ran on untraced, "
                           f"its first {rt.events} call(s) are kept")
    elif rt.truncated:
        rt.problems.append(f"{os.path.basename(path)}: last line truncated (the rank was killed "
                           "while writing); read up to it")
    return rt


def iter_records(path: str, offset: int = 0, contains: bytes | None = None):
    """The records of one trace file from a byte offset, as dicts: corrupt lines are skipped,
    reading stops at a truncated last line (a rank killed mid-write), an unreadable file yields
    nothing. ``contains``: only lines holding these bytes are decoded (a cheap pre-filter)."""
    try:
        f = open_regular(path)
    except OSError:
        return
    with f:
        if offset:
            f.seek(offset)
        for _start, raw in bounded_lines(f):
            if raw is None:
                continue
            if not raw.endswith(b"\n"):
                return
            if contains is not None and contains not in raw:
                continue
            try:
                rec = parse_line(raw)
            except (ValueError, RecursionError):
                continue
            if isinstance(rec, dict):
                yield rec


def read_group_events(path: str, group: str, offset: int, limit: int) -> list[dict]:
    """Re-read up to ``limit`` sequence events of one group from a byte offset."""
    out: list[dict] = []
    for rec in iter_records(path, offset):
        if rec.get("t") == "c" and rec.get("g", "0") == group:
            out.append(rec)
            if len(out) >= limit:
                break
    return out


