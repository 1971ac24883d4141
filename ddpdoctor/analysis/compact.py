"""Small per-rank summaries: what a loaded ``RankTrace`` keeps once reading is done.

At 1,000s of ranks the report's memory is the sum of the per-rank summaries, so after a rank's
file (or Flight Recorder dump) has been read its summary is made compact, in two steps:

* :func:`pack` (in the reader's process, before the summary is sent back): the digest blocks of
  each group go into one ``array('q')`` (:class:`Blocks`) instead of a list of lists, and the tail
  events are kept as their JSON text (:class:`LineTail`), decoded again when a check asks;
* :class:`Sharing` (in the report's process): values that are equal on many ranks (call-site
  tables, group spans, per-op counters, the empty containers of a rank that never used a feature)
  become one shared object. Most ranks of a job issue the same calls from the same lines, so these
  are stored once per distinct value instead of once per rank.

Nothing here changes what the checks see: a shared value is equal to the rank's own, and nothing
after loading mutates a summary (the loader and the sidecar reader fill them, then they are
read-only). ``tests/unit/test_compact.py`` holds that.
"""

from __future__ import annotations

import hashlib
import json
import sys
from array import array
from collections.abc import Sequence

from .conform import parse_line
from .load import GroupStream, RankTrace, read_rank

#: Distinct values remembered for sharing. A value unique to one rank (its durations, its file
#: name) must not cost a table entry per rank, so past this many the table stops growing (values
#: already in it are still shared).
MAX_SHARED = 4096


class Blocks(Sequence):
    """A group's digest blocks, ``[op digest, signature digest, file offset]`` each, in one array
    (24 bytes a block instead of ~170 for a list of three ints). Read-only."""

    __slots__ = ("_a",)

    def __init__(self, blocks=()) -> None:
        a = array("q")
        for blk in blocks:
            a.extend((int(blk[0]), int(blk[1]), int(blk[2])))
        self._a = a

    def __len__(self) -> int:
        return len(self._a) // 3

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("block index out of range")
        a = self._a
        return (a[3 * i], a[3 * i + 1], a[3 * i + 2])

    def __eq__(self, other) -> bool:
        if isinstance(other, Blocks):
            return self._a == other._a
        if isinstance(other, (list, tuple)):
            return len(other) == len(self) and all(tuple(x) == y for x, y in zip(other, self))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # equal to lists, so unhashable like them

    def __repr__(self) -> str:
        # Sharing keys every rank's groups by repr: one C pass over the array, not a Python
        # __getitem__ per block (~2 ms a rank at 20k events)
        it = iter(self._a.tolist())
        return f"Blocks({[list(b) for b in zip(it, it, it)]})"


class LineTail(Sequence):
    """The last events of a rank as JSON text, decoded on access (a fresh dict each time).

    Replaces the ``deque`` of dicts once reading is done: ~250 bytes an event instead of ~800,
    and the few readers (the text summary, rank-failed, the HTML tail) read one or all of them."""

    __slots__ = ("_lines",)

    def __init__(self, events=()) -> None:
        # ASCII JSON (json.dumps escapes the rest), read back by the loader's own line decoder
        self._lines = tuple(json.dumps(e, separators=(",", ":")).encode() for e in events)

    def __len__(self) -> int:
        return len(self._lines)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [parse_line(x) for x in self._lines[i]]
        return parse_line(self._lines[i])

    def __eq__(self, other) -> bool:
        if isinstance(other, LineTail):
            return self._lines == other._lines
        try:
            return list(self) == list(other)
        except TypeError:
            return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"LineTail({list(self)!r})"


def pack(rt: RankTrace) -> RankTrace:
    """Compact ``rt`` in place (blocks into arrays, tail events into text) and return it."""
    for gs in rt.groups.values():
        if not isinstance(gs.blocks, Blocks):
            gs.blocks = Blocks(gs.blocks)
    if not isinstance(rt.tail, LineTail):
        try:
            rt.tail = LineTail(rt.tail)
        except (ValueError, TypeError, RecursionError):  # absurd nesting in a hostile trace: keep it
            pass
    return rt


def read_packed(path: str) -> RankTrace:
    """``load.read_rank`` then :func:`pack`: what a reader worker sends back."""
    return pack(read_rank(path))


#: RankTrace fields whose values are often equal across ranks, shared by value.
_SHARED_FIELDS = ("sites", "p2p", "rare", "errors", "overlaps", "ddp_steps", "ddp_sites", "ddp_local",
                  "waits", "op_sites", "after_barrier", "last_op", "problems", "async_waits", "waited",
                  "dropped")
#: Header values (and the Flight Recorder part's values) shared by value.
_SHARED_HEADER = ("_groups", "fr_base", "torch", "backend", "tool", "source", "run")
_SHARED_FR = ("pg_status", "groups", "stuck", "version", "form")


def _canon(v):
    """``v`` with its strings interned: every decoded dict has its own copies of its keys (and of
    values such as op names), ~50 bytes each, which would otherwise be kept once per rank."""
    if isinstance(v, str):
        return sys.intern(v) if type(v) is str else v
    if type(v) is dict:
        return {_canon(k): _canon(x) for k, x in v.items()}
    if type(v) is list:
        return [_canon(x) for x in v]
    if type(v) is tuple:
        return tuple(_canon(x) for x in v)
    return v


class Sharing:
    """One table of values per report: :meth:`share` returns an equal value already seen on
    another rank when there is one. Keys are ``repr`` (plain data: dicts, lists, tuples, sets,
    strings, numbers), which tells 1 from True and from 1.0, a list from a tuple, and an int key
    from a str key; the table holds a 16-byte hash of it, so a large value costs no large key."""

    def __init__(self, limit: int = MAX_SHARED) -> None:
        self._table: dict[bytes, object] = {}
        self._limit = limit

    def share(self, value):
        try:
            key = hashlib.blake2b(repr(value).encode("utf-8", "surrogatepass"), digest_size=16).digest()
        except RecursionError:
            return value
        got = self._table.get(key)
        if got is not None:
            return got
        if len(self._table) < self._limit:
            self._table[key] = value
        return value

    def rank(self, rt: RankTrace) -> RankTrace:
        """Pack ``rt`` and share its values with the ranks seen before; returns it."""
        pack(rt)
        try:
            self._share_values(rt)
        except RecursionError:  # absurd nesting in a hostile trace: that rank keeps its own values
            pass
        return rt

    def _share_values(self, rt: RankTrace) -> None:
        # call sites one by one first: ranks often share most sites but not all
        rt.sites = {k: self.share(_canon(rec)) for k, rec in rt.sites.items()}
        for name in _SHARED_FIELDS:
            v = getattr(rt, name)
            setattr(rt, name, self.share(v if name == "sites" else _canon(v)))
        rt.header = h = _canon(rt.header)
        for k in _SHARED_HEADER:
            if k in h:
                h[k] = self.share(h[k])
        fr = h.get("fr")
        if isinstance(fr, dict):
            for k in _SHARED_FR:
                if k in fr:
                    fr[k] = self.share(fr[k])
        for name, gs in rt.groups.items():
            if isinstance(gs, GroupStream):
                gs.blocks = self.share(gs.blocks)
            rt.groups[name] = gs
        rt.groups = self.share(rt.groups)
