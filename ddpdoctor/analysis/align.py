"""Aligning the ranks' sequences per process group: where do they first differ?

Each rank's events in a group are numbered 1, 2, ... in the order it issued them; a correct
program issues the same op at the same number on every member. The loader folded sequences into
block digests; here the first block where members disagree is re-read from each file and compared
event by event, so memory stays bounded whatever the length of the run.
"""

from __future__ import annotations

import json
import sys
from array import array
from dataclasses import dataclass, field

from ..trace.records import InFlight
from . import frmodel
from .load import BLOCK, RankTrace, read_group_events, signature
from .regroup import decode, group_lines
from .run import Run


@dataclass
class Point:
    """The events of all members at one position of a group's sequence."""

    group: str
    seq: int
    events: dict[int, dict | None]  # rank -> event there, None when its sequence had ended
    counts: dict[int, int] = field(default_factory=dict)  # events per rank in the group


def _pending_event(rt: RankTrace, group: str, seq: int) -> dict | None:
    """A call the rank issued but never completed (written by the watchdog or at exit)."""
    for r in reversed(rt.rare):
        t = r.get("t")
        if t == "pending" and r.get("g") == group and r.get("s") == seq:
            return dict(r, t="c", pending=1)
        if t == "exit":
            for inf in map(InFlight.decode, r.get("inflight") or []):
                if inf is not None and inf.g == group and inf.s == seq:
                    return {"t": "c", "op": inf.op, "g": group, "s": seq, "site": inf.site,
                            "ts": inf.ts, "pending": 1}
    return None


def _group_events(path: str, group: str, offset: int):
    """(byte offset, line, record or shape, whole) of each sequence event of ``group`` in a file
    from ``offset`` (regroup.group_lines: most lines are known by their shape, not decoded)."""
    return group_lines(path, group, offset)


class _Block:
    """One rank's events of one group in one block: op and signature of each (interned) and its
    byte offset; an event is decoded again only when asked for (``blk[i]``), so comparing a block
    across 1,000 ranks holds a few bytes per event instead of every event's dict.

    ``like``: a block of another rank with the same digests (ops, signatures, length): its ops and
    signatures are this block's too, so they are not read again, and this rank's events are found
    in its own file only when asked for. Ranks that issued the same calls then cost nothing each.

    ``known``: this rank's events' offsets from ``offset`` when its reader indexed the block
    (frmodel.block_offsets): an event asked for is then read with one seek."""

    __slots__ = ("path", "group", "offset", "offsets", "ops", "sigs", "known")

    def __init__(self, path: str, group: str, offset: int, limit: int, like: _Block | None = None,
                 known=None) -> None:
        self.path, self.group, self.offset = path, group, offset
        self.offsets: array | None = array("q")
        self.ops: list[str] = []
        self.sigs: list[str] = []
        self.known = known
        if like is not None:
            self.offsets, self.ops, self.sigs = None, like.ops, like.sigs
            return
        if limit <= 0:
            return
        for start, _raw, rec, _whole in _group_events(path, group, offset):
            op = str(rec.get("op"))
            self.offsets.append(start)
            self.ops.append(sys.intern(op))
            self.sigs.append(sys.intern(op + "|" + signature(rec)))
            if len(self.ops) >= limit:
                break

    def __len__(self) -> int:
        return len(self.ops)

    def __getitem__(self, i: int) -> dict:
        if self.offsets is None:  # shares another rank's ops: find the event in this file
            if self.known is not None and 0 <= i < len(self.ops) == len(self.known):
                with open(self.path, "rb") as f:
                    f.seek(self.offset + self.known[i])
                    return json.loads(f.readline())
            if 0 <= i < len(self.ops):
                for k, (_start, raw, rec, whole) in enumerate(_group_events(self.path, self.group, self.offset)):
                    if k == i:
                        return decode(raw, rec, whole)
            raise IndexError(i)
        with open(self.path, "rb") as f:
            f.seek(self.offsets[i])
            return json.loads(f.readline())


def _block_events(run: Run, members: list[int], group: str, b: int) -> dict[int, _Block]:
    out: dict[int, _Block] = {}
    first: dict[tuple, _Block] = {}  # (op digest, signature digest, events in the block) -> its block
    for r in members:
        rt = run.ranks[r]
        gs = rt.groups.get(group)
        if gs is None or b >= len(gs.blocks):
            out[r] = _Block(rt.path, group, 0, 0)
            continue
        blk = gs.blocks[b]
        key = (blk[0], blk[1], min(BLOCK, gs.count - b * BLOCK))
        like = first.get(key)
        out[r] = _Block(rt.path, group, blk[2], BLOCK, like=like, known=frmodel.block_offsets(rt, group, b))
        if like is None:
            first[key] = out[r]
    return out


def _event_at(run: Run, r: int, evs, i: int, group: str, seq: int) -> dict | None:
    if i < len(evs):
        return evs[i]
    return _pending_event(run.ranks[r], group, seq)


def _op_at(run: Run, r: int, evs: _Block, i: int, group: str, seq: int) -> str | None:
    if i < len(evs):
        return evs.ops[i]
    pending = _pending_event(run.ranks[r], group, seq)
    return None if pending is None else pending.get("op")


def first_divergence(run: Run, group: str) -> Point | None:
    """First position where members issued different ops, or some stopped and others went on."""
    members = [r for r in run.group_members(group) if r in run.ranks]
    if len(members) < 2:
        return None
    p = _first_divergence(run, group, members)
    base = frmodel.base(run, group)  # FR ring buffers: positions start after the lost entries
    if p is not None and base:
        p.seq += base
        p.counts = {r: c + base for r, c in p.counts.items()}
    return p


def _first_divergence(run: Run, group: str, members: list[int]) -> Point | None:
    counts = {r: (run.ranks[r].groups[group].count if group in run.ranks[r].groups else 0)
              for r in members}
    nblocks = max((len(run.ranks[r].groups[group].blocks) if group in run.ranks[r].groups else 0)
                  for r in members)
    for b in range(nblocks):
        digests = set()
        for r in members:
            gs = run.ranks[r].groups.get(group)
            blk = gs.blocks[b] if gs is not None and b < len(gs.blocks) else None
            n_in_block = max(0, min(BLOCK, counts[r] - b * BLOCK))
            digests.add((blk[0] if blk else None, n_in_block))
        if len(digests) == 1:
            continue
        evs = _block_events(run, members, group, b)
        for i in range(BLOCK):
            seq = b * BLOCK + i + 1
            if all(i >= len(evs[r]) for r in members):
                at = {r: _event_at(run, r, evs[r], i, group, seq) for r in members}
                ops = {(e or {}).get("op") for e in at.values()}
                if all(e is None for e in at.values()):
                    break
            else:  # compare the kept ops; decode the events only where they differ
                ops = {_op_at(run, r, evs[r], i, group, seq) for r in members}
                if len(ops) > 1:
                    at = {r: _event_at(run, r, evs[r], i, group, seq) for r in members}
            if len(ops) > 1:
                return Point(group, seq, at, counts)
        # Digests differed but no event did: a pending tail on a shorter rank; fall through.
    # Equal recorded sequences may still differ by a call that one rank issued and never finished.
    top = max(counts.values(), default=0)
    at = {r: _pending_event(run.ranks[r], group, top + 1) for r in members}
    if any(e is not None for e in at.values()) and len({(e or {}).get("op") for e in at.values()}) > 1:
        return Point(group, top + 1, at, counts)
    return None


def mismatches(run: Run, group: str, until_seq: int | None, limit: int = 5) -> list[Point]:
    """Positions (before the first divergence) where the same op had different metadata."""
    members = [r for r in run.group_members(group) if r in run.ranks]
    if len(members) < 2:
        return []
    base = frmodel.base(run, group)
    if base:  # FR ring buffers: positions start after the lost entries
        found = _mismatches(run, group, members, None if until_seq is None else until_seq - base, limit)
        for p in found:
            p.seq += base
        return found
    return _mismatches(run, group, members, until_seq, limit)


def _mismatches(run: Run, group: str, members: list[int], until_seq: int | None, limit: int) -> list[Point]:
    found: list[Point] = []
    nblocks = min((len(run.ranks[r].groups[group].blocks) if group in run.ranks[r].groups else 0)
                  for r in members)
    for b in range(nblocks):
        if until_seq is not None and b * BLOCK + 1 >= until_seq:
            break
        sigs = {run.ranks[r].groups[group].blocks[b][1] for r in members}
        ops = {run.ranks[r].groups[group].blocks[b][0] for r in members}
        if len(sigs) == 1:
            continue
        evs = _block_events(run, members, group, b)
        n = min(len(e) for e in evs.values())
        for i in range(n):
            seq = b * BLOCK + i + 1
            if until_seq is not None and seq >= until_seq:
                break
            if len({evs[r].ops[i] for r in members}) > 1:
                break
            if len({evs[r].sigs[i] for r in members}) > 1:
                found.append(Point(group, seq, {r: evs[r][i] for r in members}))
                if len(found) >= limit:
                    return found
        del ops
    if len(found) < limit:
        tail = _pending_tail_mismatch(run, members, group, until_seq)
        if tail is not None:
            found.append(tail)
    seen = {p.seq for p in found}
    for p in _died_inside_mismatches(run, members, group, until_seq):
        if p.seq not in seen:
            found.append(p)
            seen.add(p.seq)
    found.sort(key=lambda p: p.seq)
    return found[:limit]


def _died_inside_mismatches(run: Run, members: list[int], group: str, until_seq: int | None) -> list[Point]:
    """A rank that died inside call #k (its in-flight record) while other ranks completed #k and
    went on: gloo can complete a mismatched all_gather on one side and abort the other, so the
    block digests never cover the dead rank's #k. Compare its call with theirs at #k."""
    counts = {r: (run.ranks[r].groups[group].count if group in run.ranks[r].groups else 0) for r in members}
    out = []
    for r in members:
        seq = counts[r] + 1
        if (until_seq is not None and seq >= until_seq) or not any(counts[o] >= seq for o in members):
            continue
        mine = _pending_event(run.ranks[r], group, seq)
        if mine is None:
            continue
        at: dict[int, dict | None] = {r: mine}
        for o in members:
            if o == r:
                continue
            if counts[o] >= seq:
                gs = run.ranks[o].groups[group]
                b = (seq - 1) // BLOCK
                evs = read_group_events(run.ranks[o].path, group, gs.blocks[b][2], BLOCK)
                if len(evs) > (seq - 1) % BLOCK:
                    at[o] = evs[(seq - 1) % BLOCK]
            elif counts[o] + 1 == seq:
                at[o] = _pending_event(run.ranks[o], group, seq)
        evs_at = [e for e in at.values() if e is not None]
        if len(evs_at) >= 2 and len({e.get("op") for e in evs_at}) == 1 \
                and len({signature(e) for e in evs_at}) > 1:
            out.append(Point(group, seq, {k: v for k, v in at.items() if v is not None}))
    return out


def _pending_tail_mismatch(run: Run, members: list[int], group: str, until_seq: int | None) -> Point | None:
    """A rank that died inside a collective (gloo aborts on mismatched sizes) completed one
    event less than the others: compare its in-flight call with theirs at that position."""
    counts = {r: (run.ranks[r].groups[group].count if group in run.ranks[r].groups else 0) for r in members}
    top = max(counts.values(), default=0)
    if until_seq is not None and top >= until_seq:
        return None
    # Every rank died inside the same call (one aborted, the launcher ended the others).
    if all(c == top for c in counts.values()):
        at0 = {r: _pending_event(run.ranks[r], group, top + 1) for r in members}
        if all(e is not None for e in at0.values()) and len({e.get("op") for e in at0.values()}) == 1 \
                and len({signature(e) for e in at0.values()}) > 1:
            return Point(group, top + 1, at0)
        return None
    at: dict[int, dict | None] = {}
    for r in members:
        if counts[r] == top:
            gs = run.ranks[r].groups[group]
            b = (top - 1) // BLOCK
            evs = read_group_events(run.ranks[r].path, group, gs.blocks[b][2], BLOCK)
            at[r] = evs[(top - 1) % BLOCK] if len(evs) > (top - 1) % BLOCK else None
        elif counts[r] == top - 1:
            at[r] = _pending_event(run.ranks[r], group, top)
        else:
            return None
    if any(e is None for e in at.values()) or not any(e.get("pending") for e in at.values()):
        return None
    if len({e.get("op") for e in at.values()}) > 1 or len({signature(e) for e in at.values()}) == 1:
        return None
    return Point(group, top, at)


def all_groups(run: Run) -> list[str]:
    names: set[str] = set()
    for rt in run.ranks.values():
        names.update(rt.groups)
        # a group whose only call never completed (the rank died inside it)
        names.update(str(r.get("g", "0")) for r in rt.rare if r.get("t") == "pending")
    return sorted(names, key=lambda g: (g != "0", len(g), g))
