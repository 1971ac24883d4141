"""Reading trace folders: one streaming pass per rank file into a compact ``RankTrace``.

Memory does not grow with events per rank: sequence events are folded into per-group block
digests (with the file offset of each block, so the aligner can re-read just the block where
ranks differ); the rare records (groups, files, seeds, samplers, exits, hangs) are kept whole.
Corrupt or truncated lines are skipped and counted, never fatal.
"""

from __future__ import annotations

import json
import os
import zlib
from collections import deque
from dataclasses import dataclass, field

from .tracefile import PREFIX, SCHEMA_VERSION, SUFFIX

#: Sequence events per digest block.
BLOCK = 256
#: Last events kept per rank for the summary and failure analysis.
TAIL = 20
#: Ops whose tensors legitimately differ in shape across ranks.
ASYMMETRIC_OPS = frozenset({"all_to_all", "all_to_all_single"})
_SIG_KEYS = ("x", "rop", "root", "groot", "nobj")
_RARE = frozenset({"pg", "init", "file", "file_cap", "seed", "split", "sampler", "set_epoch", "optim",
                   "ddp", "exit", "hang", "pending", "w"})


#: Ops counted as barriers (RankTrace.after_barrier).
BARRIER_OPS = frozenset({"barrier", "monitored_barrier"})
# Fields whose type the loader relies on; a record with another type there is skipped as corrupt.
_TYPED = (("t", str), ("op", str), ("g", str), ("ch", str), ("d", int), ("ts", (int, float)),
          ("s", int), ("site", (int, type(None))))


def _well_typed(rec: dict) -> bool:
    for key, typ in _TYPED:
        v = rec.get(key)
        if v is not None and not isinstance(v, typ):
            return False
    return True


class TraceError(Exception):
    """A problem with the input that the user must fix (a missing or empty folder)."""


def signature(rec: dict) -> str:
    """What must agree across ranks for the same collective (besides the op)."""
    if rec.get("op") in ASYMMETRIC_OPS:
        return rec.get("rop", "")
    return "|".join(str(rec.get(k, "")) for k in _SIG_KEYS)


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
        f = open(path, "rb")
    except OSError as exc:
        rt.problems.append(f"cannot read {path}: {exc.strerror}")
        return rt
    loads = json.loads
    crc = zlib.crc32
    with f:
        offset = 0
        for raw in f:
            start = offset
            offset += len(raw)
            if not raw.endswith(b"\n"):
                rt.truncated = True  # a rank killed mid-write: tolerated
                break
            try:
                rec = loads(raw)
            except ValueError:
                rt.bad_lines += 1
                continue
            if not isinstance(rec, dict) or not _well_typed(rec):
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
                rt.sites[rec.get("id")] = rec
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
                if rt.header:
                    rt.problems.append(f"{os.path.basename(path)}: second header ignored")
                else:
                    rt.header = rec
            elif t in _RARE:
                if len(rt.rare) < 200000:
                    rt.rare.append(rec)
                ts = rec.get("ts")
                if isinstance(ts, int) and ts > rt.last_ts:
                    rt.last_ts = ts
                if t == "pg" and rec.get("ranks") is not None:
                    rt.header.setdefault("_groups", {})[rec.get("g")] = rec.get("ranks")
            else:
                rt.bad_lines += 0  # unknown record types from newer writers are skipped
    for gs in rt.groups.values():
        if gs.blocks:
            gs.blocks[-1][0], gs.blocks[-1][1] = gs._op, gs._sig
    if not rt.header:
        rt.problems.append(f"{os.path.basename(path)}: no header record (not a ddpdoctor trace?)")
    elif int(rt.header.get("schema", 0)) > SCHEMA_VERSION:
        rt.problems.append(f"{os.path.basename(path)}: written by a newer ddpdoctor "
                           f"(schema {rt.header.get('schema')}); some records may be ignored")
    if rt.bad_lines:
        rt.problems.append(f"{os.path.basename(path)}: {rt.bad_lines} corrupt line(s) skipped")
    if rt.truncated:
        rt.problems.append(f"{os.path.basename(path)}: last line truncated (the rank was killed "
                           "while writing); read up to it")
    return rt


def read_group_events(path: str, group: str, offset: int, limit: int) -> list[dict]:
    """Re-read up to ``limit`` sequence events of one group from a byte offset."""
    out: list[dict] = []
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            for raw in f:
                if not raw.endswith(b"\n"):
                    break
                try:
                    rec = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(rec, dict) and rec.get("t") == "c" and rec.get("g", "0") == group:
                    out.append(rec)
                    if len(out) >= limit:
                        break
    except OSError:
        pass
    return out
