"""The loader's bulk path: ``c`` records of the writer's layout read 256 KiB at a time.

Most of a trace is ``c`` lines that repeat a few *shapes*: lines equal but for the values of
``s``, ``ts``, ``d`` (and ``step``). One ``findall`` per chunk (:data:`_SCAN`) splits every such
line into its shape key and its varying numbers in C; per chunk, the lines are then accounted
with whole-column operations (``map``, ``join``, one ``crc32`` per digest block and group)
instead of Python work per line; short runs between lines of other kinds go line by line.
Before, the per-line loop (a ``readline`` generator, a regex ``match``, ``group`` calls, ~40
bytecodes a line) was ~90% of ``ddpdoctor report`` on the scale benchmark's traces; now the regex
itself is more than half of the reading (bench/README.md, session 4).

What the bulk path takes is exactly what ``json.loads`` reads (``tests/unit/test_load_fastpath.py``
reads files both ways): a shape is trusted only after its first line was decoded with json and
checked (:meth:`Shape.make`); every other line (other record types, other field orders, errors,
corrupt and over-long lines, a truncated or NUL-padded tail) is handed to the loader's general,
line-by-line path, in file order.

Where the optional C extension is built (``_bulkscan.c``, :data:`NATIVE`), the same accounting runs
a line at a time in C with the pattern's text rules and no regex (~1.7k instead of ~20k
instructions an event, bench/README.md session 6); the Python path below is the reference it is
tested against (``tests/unit/test_bulkscan.py``).
"""

from __future__ import annotations

import gc
import json
import re
import sys
import zlib
from collections import deque
from itertools import accumulate, compress, count, repeat
from operator import add, attrgetter, is_, itemgetter

from ..trace import ops
from . import native
from .conform import MAX_LINE

#: The bulk path in C (_bulkscan.c: the same accounting a line at a time, no regex), or None:
#: not built, or ``DDPDOCTOR_NATIVE=0``; then the Python path below, which stays the reference.
NATIVE = native.load("_bulkscan")

#: Bytes read at a time, at most the longest line the loader accepts (MAX_LINE), so a line fully
#: inside one read is never too long and only the line a read continues needs a check. A chunk's
#: rows are held while it is accounted: with 1 MiB reads a reader's peak RSS was ~7 MB higher
#: than the line-by-line reader's on the scale benchmark's 64 x 20k traces, with 256 KiB the same.
CHUNK = 256 << 10
#: Runs of fewer lines of known shapes are accounted line by line (Bulk._short).
SHORT_RUN = 24
#: Ops whose tensors legitimately differ in shape across ranks.
ASYMMETRIC_OPS = ops.ASYMMETRIC_OPS
_SIG_KEYS = ("x", "rop", "root", "groot", "nobj")


def signature(rec: dict) -> str:
    """What must agree across ranks for the same collective (besides the op)."""
    if rec.get("op") in ASYMMETRIC_OPS:
        return rec.get("rop", "")
    return "|".join(str(rec.get(k, "")) for k in _SIG_KEYS)


def _pattern(capture: bool, possessive: bool) -> bytes:
    """The ``c`` line of the writer's layout (ddpdoctor/rank/patches/dist.py, ddp.py):
    ``{"t":"c","op":OP,"g":G,"s":N,<more fields,>"ts":N,"d":N,"site":N[,"step":N]<more>}``.
    Named groups: ``line``, and the shape key's parts ``opg`` (op and group), ``mid`` (the fields
    between ``s`` and ``ts``), ``site`` (with the ``step`` key when there is one), ``rest``;
    ``ts`` and ``d``; with ``capture``, ``s`` and ``step`` too (for Shape.make). Numbers have at
    most 18 digits, below the loader's integer bound, so a line with a larger one is left to the
    general path, which skips it as corrupt. Every run stops at a quote, a fixed key or the end
    of the line, so a line matches in one way, in linear time; the possessive quantifiers (3.11+)
    only spare the engine its backtracking state."""
    num = rb"(?:0|[1-9][0-9]{0,17}+)"

    def cap(name: bytes) -> bytes:
        return b"(?P<" + name + b">" + num + b")" if capture else num

    pat = (rb'(?P<line>\{"t":"c","op":"(?P<opg>[^"\\\n]*+","g":"[^"\\\n]*+)","s":' + cap(b"s")
           + rb',(?P<mid>[^"\n]*+(?:"(?!ts":)[^"\n]*+)*+)"ts":(?P<ts>' + num + rb'),"d":(?P<d>' + num
           + rb'),"site":(?P<site>-?[0-9]++(?P<st>,"step":)?)(?(st)' + cap(b"step") + rb')(?P<rest>.*)\}\n)')
    if not possessive:
        pat = pat.replace(b"*+", b"*").replace(b"++", b"+").replace(b"}+", b"}")
    return pat


_POSSESSIVE = sys.version_info >= (3, 11)
#: One line, with ``s`` and ``step`` captured (Shape.make, tests).
LINE = re.compile(_pattern(True, _POSSESSIVE))
LINE_PLAIN = re.compile(_pattern(True, False))
#: A chunk: any lines that are not of the layout (group ``gap``), then one that is, or the end.
_SCAN = re.compile(rb"^(?P<gap>(?:[^\n]*\n)*?)(?:" + _pattern(False, _POSSESSIVE) + rb"|\Z)", re.M)
_GAP, _LINE, _TS, _D = (_SCAN.groupindex[k] - 1 for k in ("gap", "line", "ts", "d"))
_KEY_PARTS = ("opg", "mid", "site", "rest")
_KEY = itemgetter(*(_SCAN.groupindex[k] - 1 for k in _KEY_PARTS))


def line_key(m) -> tuple:
    """The shape key of a :data:`LINE` match: what _SCAN's row gives for the same line."""
    return tuple(m.group(k) for k in _KEY_PARTS)


# stand-in values for the varying fields, to check that the numbers found are those fields
_STAND_IN = {"s": 987654321, "ts": 987654322, "d": 987654323, "step": 987654324}


class Shape:
    """What every ``c`` line of one shape contributes, computed from its first line."""

    __slots__ = ("tmpl", "gs", "g", "op", "op_b", "sig_b", "opsite", "site", "ddp", "train_fwd",
                 "barrier", "n", "total", "longest")

    def __init__(self, rec: dict, gs, barrier_ops) -> None:
        self.tmpl = dict(rec)
        self.gs = gs
        self.g = rec.get("g", "0")
        self.op = rec.get("op", "?")
        self.op_b = self.op.encode()
        self.sig_b = (self.op + "|" + signature(rec)).encode()
        self.site = rec.get("site")
        self.opsite = (self.op, self.site)
        self.ddp = self.op in ops.DDP_STEPS
        self.train_fwd = bool(rec.get("grad")) and self.op == "ddp_forward"
        self.barrier = self.op in barrier_ops
        self.n = self.total = self.longest = 0  # events taken by the bulk path; sum, max of d

    @staticmethod
    def make(raw: bytes, rec: dict, gs, barrier_ops) -> Shape | None:
        """The shape of this line (decoded as ``rec``), or None (never the bulk path) for a rare
        kind of event or when the pattern's numbers are not plainly the fields: checked by
        decoding the line again with other numbers in their places."""
        if "err" in rec or "ddp_overlap" in rec or rec.get("t") != "c":
            return None
        m = LINE.match(raw)
        if m is None:
            return None
        parts, pos, want = [], 0, {}
        for name, val in _STAND_IN.items():
            if m.start(name) >= 0:
                parts += [raw[pos:m.start(name)], str(val).encode()]
                pos = m.end(name)
                want[name] = val
        parts.append(raw[pos:])
        try:
            alt = json.loads(b"".join(parts))
        except ValueError:
            return None
        if not isinstance(alt, dict) or any(alt.get(k) != v or type(rec.get(k)) is not int
                                            for k, v in want.items()):
            return None
        if {k: v for k, v in alt.items() if k not in want} != {k: v for k, v in rec.items() if k not in want}:
            return None
        return Shape(rec, gs, barrier_ops)


def chunks(f, size: int = CHUNK):
    """The file as (offset, item): ``item`` is whole lines (bytes ending in a newline), ``None``
    for an over-long line (more than MAX_LINE bytes before its newline; its rest is skipped), or the
    last line when it has no newline. The same lines as ``conform.bounded_lines``. ``size``: bytes
    a read, at most CHUNK (less for a reader that wants a few lines)."""
    off = 0  # file offset of buf[0]
    carry = b""
    skipping = False
    read = f.read
    size = min(size, CHUNK, MAX_LINE)  # (see CHUNK)
    while True:
        data = read(size)
        if not data:
            break
        if skipping:  # the rest of an over-long line
            i = data.find(b"\n")
            if i < 0:
                off += len(data)
                continue
            off += i + 1
            data = data[i + 1:]
            skipping = False
        buf = carry + data if carry else data
        first = buf.find(b"\n")
        if first > MAX_LINE or (first < 0 and len(buf) > MAX_LINE):
            yield off, None
            if first < 0:
                off += len(buf)
                carry = b""
                skipping = True
                continue
            off += first + 1
            buf = buf[first + 1:]
        end = buf.rfind(b"\n") + 1
        if end:
            yield off, buf[:end] if end < len(buf) else buf
            off += end
        carry = buf[end:]
        if len(carry) > MAX_LINE:
            yield off, None
            off += len(carry)
            carry = b""
            skipping = True
    if carry:
        yield off, carry


class Bulk:
    """Accounts runs of ``c`` lines of known shapes into a RankTrace, as the general path would
    one by one: per group, the digest blocks (``crc32`` over the joined op and signature bytes
    of a block equals the per-event chained ``crc32``) and their file offsets; per shape, the
    count and the sum and maximum of ``d``; the latest end; the barrier successors; DDP steps;
    the last event per group; the tail (raw lines, decoded when reading ends)."""

    def __init__(self, rt, shapes: dict, block: int) -> None:
        self.rt = rt
        self.shapes = shapes
        self.block = block
        self.n = 0  # events taken
        self.end = 0  # their latest end (ts + d)
        self._native = None  # the C scanner of this file, while scan() uses it

    def finish(self) -> None:
        """After :meth:`scan` (complete or not): the counts the C path keeps until the end (each
        shape's ``n``, ``total``, ``longest``; :attr:`n` and :attr:`end`) written out."""
        if self._native is not None:
            n, end = self._native.finish()
            self.n += n
            if end > self.end:
                self.end = end

    def scan(self, f, fast: bool = True):
        """Yield (offset, line, shape key or None) of each line the general path must read, in
        file order, accounting every other line in between."""
        if not fast:
            for off, line in _lines(f):
                yield off, line, None
            return
        # A chunk makes ~10 objects a line, all freed by reference counting; the cyclic
        # collector would walk them every 700 allocations (~9% of the time, callgrind).
        collecting = gc.isenabled()
        gc.disable()
        try:
            if NATIVE is not None:
                yield from self._scan_native(f)
                return
            shapes = self.shapes
            for off, item in chunks(f):
                if item is None or not item.endswith(b"\n"):
                    yield off, item, None
                    continue
                rows = _SCAN.findall(item)
                if rows and not rows[-1][_LINE]:
                    last = rows.pop()  # the chunk ends with lines of other kinds, or at a row's end
                    if last[_GAP]:
                        rows.append(last)
                keys = list(map(_KEY, rows))
                shs = list(map(shapes.get, keys))
                n = len(rows)
                if None not in shs:
                    lines = list(map(_LINE_OF, rows))
                    starts = list(accumulate(map(len, lines), initial=off))
                    if starts[-1] - off == len(item):  # no lines of other kinds: one run
                        self._run(rows, shs, off, lines, starts)
                        continue
                # Rows where a run stops: after lines of other kinds (a gap), or with no known shape
                # when the chunk was mapped. A shape found meanwhile (its first line was just read)
                # is looked up again there; the chunk is mapped again only once that was frequent.
                gaps = list(compress(count(), map(bool, map(itemgetter(_GAP), rows))))
                gaps.append(n)
                gp = 0
                nn = _none_at(shs, 0, n)
                late = 0  # rows of a shape found after the chunk was mapped
                pos = off  # file offset of rows[i]
                i = 0
                while i < n:
                    g = gaps[gp]
                    j = g if g < nn else nn
                    if j - i >= SHORT_RUN:
                        pos = self._run(rows[i:j], shs[i:j], pos)
                    elif j > i:
                        pos = self._short(rows, shs, i, j, pos)
                    if j >= n:
                        break
                    row = rows[j]
                    if j == g:
                        gp += 1
                        for line in _split(row[_GAP]):
                            yield pos, line, None
                            pos += len(line)
                    line = row[_LINE]
                    if not line:  # the lines of other kinds that end the chunk
                        break
                    sh = shs[j] if j != nn else shapes.get(keys[j])
                    if sh is not None:  # the first of a run
                        if j == nn:
                            shs[j] = sh
                            late += 1
                            if late > (n - j) >> 3:
                                shs[j:] = map(shapes.get, keys[j:])
                                late = 0
                            nn = _none_at(shs, j + 1, n)
                        i = j
                        continue
                    yield pos, line, keys[j]
                    pos += len(line)
                    i = j + 1
                    nn = _none_at(shs, i, n)
        finally:
            if collecting:
                gc.enable()

    def _scan_native(self, f):
        """:meth:`scan` through the C scanner: it accounts the lines of known shapes and hands
        back each other line (with its shape key when it is of the layout), in file order."""
        sc = self._native = NATIVE.Scanner(self.rt, self.shapes, self.block, _BARRIERS, _DDP_OPS)
        run = sc.run
        for off, item in chunks(f):
            if item is None or not item.endswith(b"\n"):
                yield off, item, None
                continue
            n = len(item)
            i = 0
            while True:
                i, j, key = run(item, i, off)
                if i >= n:
                    break
                yield off + i, item[i:j], key
                i = j

    def _run(self, rows: list, seg: list, pos: int, lines: list | None = None,
             starts: list | None = None) -> int:
        """Account ``rows`` (lines of known shapes ``seg``, one after the other from file offset
        ``pos``; ``lines`` and ``starts`` when the caller has them); returns the offset after them."""
        if len(seg) < SHORT_RUN:
            return self._short(rows, seg, 0, len(seg), pos)
        rt = self.rt
        if lines is None or starts is None:
            lines = list(map(_LINE_OF, rows))
            starts = list(accumulate(map(len, lines), initial=pos))  # offsets of the lines, then the end
        ds = list(map(int, map(itemgetter(_D), rows)))
        end = max(map(add, map(int, map(itemgetter(_TS), rows)), ds))
        if end > self.end:
            self.end = end
        self.n += len(seg)
        # each shape's durations, gathered in C (a list per shape, appended to through map)
        per: dict = {sh: [] for sh in dict.fromkeys(seg)}
        deque(map(list.append, map(per.__getitem__, seg), ds), maxlen=0)
        for sh, dl in per.items():
            sh.n += len(dl)
            sh.total += sum(dl)
            top = max(dl)
            if top > sh.longest:
                sh.longest = top
        distinct = list(per)  # first-occurrence order
        groups = {id(sh.gs): sh.gs for sh in distinct}
        if len(groups) == 1:
            self._group(distinct[0].gs, seg, starts, None)
        else:
            for gs in groups.values():
                idx = list(compress(count(), map(is_, map(attrgetter("gs"), seg), repeat(gs))))
                self._group(gs, [seg[x] for x in idx], starts, idx)
        self._successors(seg, distinct, len(groups) > 1)
        if any(sh.ddp for sh in distinct):
            steps, sites = rt.ddp_steps, rt.ddp_sites
            for sh in distinct:
                if sh.ddp:
                    steps[sh.op] += len(per[sh])
                    if sh.train_fwd:
                        rt.ddp_train_fwd += len(per[sh])
            done = set()
            for sh in reversed(seg):
                if sh.ddp and sh.op not in done:
                    done.add(sh.op)
                    sites[sh.op] = sh.site
                    if len(done) == len(ops.DDP_STEPS):
                        break
        rt.tail.extend(lines[-rt.tail.maxlen:] if rt.tail.maxlen else lines)
        return starts[-1]

    def _short(self, rows: list, seg: list, i: int, j: int, pos: int) -> int:
        """What :meth:`_run` does, line by line: cheaper for a few lines between lines of other
        kinds (a DDP job's "e" and "w" records, p2p), where column operations cost more than
        they save."""
        rt = self.rt
        block = self.block
        crc = zlib.crc32
        last_op, after, tail = rt.last_op, rt.after_barrier, rt.tail
        end = self.end
        for x in range(i, j):
            row, sh = rows[x], seg[x]
            gs = sh.gs
            c = gs.count
            if c % block == 0:
                if c:
                    gs.blocks[-1][0], gs.blocks[-1][1] = gs._op, gs._sig
                gs.blocks.append([0, 0, pos])
                gs._op = gs._sig = 0
            gs._op = crc(sh.op_b, gs._op)
            gs._sig = crc(sh.sig_b, gs._sig)
            gs.count = c + 1
            d = int(row[_D])
            sh.n += 1
            sh.total += d
            if d > sh.longest:
                sh.longest = d
            e = int(row[_TS]) + d
            if e > end:
                end = e
            if sh.ddp:
                rt.ddp_steps[sh.op] += 1
                rt.ddp_sites[sh.op] = sh.site
                if sh.train_fwd:
                    rt.ddp_train_fwd += 1
            prev = last_op[sh.g]
            if prev[0] in _BARRIERS:
                k = (prev[1], sh.op)
                after[k] = after.get(k, 0) + 1
            last_op[sh.g] = sh.opsite
            line = row[_LINE]
            tail.append(line)
            pos += len(line)
        self.end = end
        self.n += j - i
        return pos

    def _group(self, gs, seg: list, starts: list, idx: list | None) -> None:
        """The digest blocks of one group's events ``seg`` (at rows ``idx`` of the run)."""
        block = self.block
        at, n = 0, len(seg)
        crc = zlib.crc32
        while at < n:
            c = gs.count
            if c % block == 0:
                if c:
                    gs.blocks[-1][0], gs.blocks[-1][1] = gs._op, gs._sig
                gs.blocks.append([0, 0, starts[at if idx is None else idx[at]]])
                gs._op = gs._sig = 0
            take = min(n - at, block - c % block)
            piece = seg[at:at + take] if take < n else seg
            gs._op = crc(b"".join(map(_OP_B, piece)), gs._op)
            gs._sig = crc(b"".join(map(_SIG_B, piece)), gs._sig)
            gs.count = c + take
            at += take

    def _successors(self, seg: list, distinct: list, several: bool) -> None:
        """``after_barrier`` (the op that follows a barrier in its group) and ``last_op``."""
        last_op = self.rt.last_op
        after = self.rt.after_barrier
        if not several:
            # one group: only the events after a barrier (few) are looked at
            prev = last_op[seg[0].g]
            if prev[0] in _BARRIERS:
                k = (prev[1], seg[0].op)
                after[k] = after.get(k, 0) + 1
            if any(sh.barrier for sh in distinct):
                # barriers are few: found by list.index (a C scan by identity), then in file order
                last, at = len(seg) - 1, []
                for sh in distinct:
                    if sh.barrier:
                        x = -1
                        try:
                            while True:
                                x = seg.index(sh, x + 1, last)
                                at.append(x)
                        except ValueError:
                            pass
                for x in sorted(at):
                    k = (seg[x].site, seg[x + 1].op)
                    after[k] = after.get(k, 0) + 1
            last_op[seg[-1].g] = seg[-1].opsite
            return
        for sh in seg:  # several groups (rare): the plain loop, in file order
            prev = last_op.get(sh.g)
            if prev is not None and prev[0] in _BARRIERS:
                k = (prev[1], sh.op)
                after[k] = after.get(k, 0) + 1
            last_op[sh.g] = sh.opsite


_BARRIERS = ops.BARRIER_OPS
_DDP_OPS = tuple(sorted(ops.DDP_STEPS))
_LINE_OF = itemgetter(_LINE)
_OP_B, _SIG_B = attrgetter("op_b"), attrgetter("sig_b")


def _none_at(shs: list, i: int, n: int) -> int:
    """Index of the next row from ``i`` with no known shape, or ``n``."""
    try:
        return shs.index(None, i)
    except ValueError:
        return n


def _split(text: bytes) -> list:
    """Lines of ``text`` (whole lines), split at newlines only."""
    out = text.split(b"\n")
    out.pop()  # after the last newline
    return [x + b"\n" for x in out]


def _lines(f):
    """(offset, line) of every line, split at newlines only (the reference path)."""
    for off, item in chunks(f):
        if item is None or not item.endswith(b"\n"):
            yield off, item
            continue
        pos = off
        for line in _split(item):
            yield pos, line
            pos += len(line)
