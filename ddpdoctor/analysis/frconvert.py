"""One Flight Recorder dump converted into a ddpdoctor trace (schema 1), in one streaming pass.

Mapping (see docs/flight-recorder.md):


* an entry with a ``collective_seq_id`` is a ``c`` event of its process group at that position;
  op from ``profiling_name`` (``nccl:all_reduce`` -> ``all_reduce``); ``x`` / ``xo`` from the
  input / output sizes and dtypes; ``site`` from the first frame outside torch and the standard
  library, with the source line and its enclosing branches when the file is readable here;
  an entry that has not completed (NCCL state not ``completed``, or not ``retired`` for gloo
  whose state stays ``scheduled``) is marked ``pending``;
* a p2p entry (``nccl:send 0->1``) is a ``p`` message on its channel;
* ring buffers: a rank's buffer holds the last N entries, so a group's positions are compared from
  the first position every dump still holds (``fr_base``); what came before is named in a note.
"""

from __future__ import annotations

import gc
import json
import linecache
import os
import re
import zlib
from array import array
from collections import deque
from itertools import compress
from operator import itemgetter, methodcaller, sub

from ..trace import sourceinfo
from . import frdump, frnative
from .load import BARRIER_OPS, BLOCK, GroupStream, RankTrace, signature

#: Run id given to the ranks read from Flight Recorder dumps.
RUN_ID = "fr"
#: Last events kept per rank (load.TAIL for ddpdoctor traces): per-rank memory at 1,000s of ranks.
FR_TAIL = 4
#: Convert in worker processes from this many dumps on.
PARALLEL_FROM = 16
#: c10 scalar type names (FR's dtypes) -> torch dtype names (ddpdoctor's ``x``).
_DTYPES = {"Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16",
           "Long": "int64", "Int": "int32", "Short": "int16", "Char": "int8", "Byte": "uint8",
           "Bool": "bool", "ComplexFloat": "complex64", "ComplexDouble": "complex128",
           "ComplexHalf": "complex32", "UInt16": "uint16", "UInt32": "uint32", "UInt64": "uint64"}
#: FR's op names -> the public function names ddpdoctor records.
_OPS = {"allreduce": "all_reduce", "allgather": "all_gather", "_allgather_base": "all_gather_into_tensor",
        "allgather_into_tensor_coalesced": "all_gather_into_tensor_coalesced",
        "_reduce_scatter_base": "reduce_scatter_tensor", "reduce_scatter_tensor": "reduce_scatter_tensor",
        "alltoall_base": "all_to_all_single", "alltoall": "all_to_all",
        "allreduce_coalesced": "all_reduce_coalesced", "ALLGATHER_coalesced": "all_gather_coalesced",
        "REDUCE_SCATTER_coalesced": "reduce_scatter_coalesced"}
#: Frames of these are never the user's call site.
_LIB = re.compile(r"([/\\](site|dist)-packages[/\\]torch[/\\])|([/\\]torch[/\\](distributed|nn|autograd|"
                  r"_tensor\.py|utils|_dynamo|_functorch|multiprocessing)[/\\.])|(^<)")
_STDLIB = re.compile(r"[/\\]lib[/\\]python3\.\d+[/\\](?!(site|dist)-packages)")
_SEND = re.compile(r"^\s*(\d+)\s*->\s*(\d+)\s*$")
_RECV = re.compile(r"^\s*(\d+)\s*<-\s*(\d+)\s*$")
C_LINE = re.compile(rb'^\{"t":"c","g":("(?:[^"\\]|\\.)*"),"s":([0-9]+),')
NO_STACK = "(no stack in the dump)"


#: ddpdoctor's own frames (dumps taken under ``ddpdoctor trace``): the whole package.
_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _is_library(filename: str) -> bool:
    return bool(_LIB.search(filename) or _STDLIB.search(filename) or filename.startswith(_HERE)
                or "-packages/ddpdoctor/" in filename)


def _dumps(v) -> str:
    return json.dumps(v, separators=(",", ":"), default=str)


def _dtype(d) -> str:
    d = str(d)
    return _DTYPES.get(d, d.lower())


def _tensors(sizes, dtypes) -> tuple[list[str], int]:
    out, n = [], 0
    if not isinstance(sizes, (list, tuple)):
        return out, 0
    dtypes = dtypes if isinstance(dtypes, (list, tuple)) else []
    for i, shape in enumerate(sizes):
        shape = list(shape) if isinstance(shape, (list, tuple)) else []
        dt = _dtype(dtypes[i]) if i < len(dtypes) else "?"
        out.append(f"{dt}[{','.join(str(s) for s in shape)}]")
        k = 1
        for s in shape:
            k *= int(s) if isinstance(s, int) else 1
        n += k
        if len(out) >= 16:
            out.append(f"...{len(sizes)} items")
            break
    return out, n


def _pg(pg, pg_id) -> tuple[str, str]:
    if isinstance(pg, (list, tuple)) and pg:
        return str(pg[0]), str(pg[1]) if len(pg) > 1 else ""
    return str(pg_id), ""


def _int(v, default: int = 0) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return default


def _ranks_of(cfg) -> list[int] | None:
    """A pg_config entry's ranks: a list or its string form ``"[0, 1]"``; None when unknown."""
    ranks = cfg.get("ranks") if isinstance(cfg, dict) else None
    if isinstance(ranks, str):
        try:
            ranks = json.loads(ranks)
        except ValueError:
            return None
    if isinstance(ranks, list) and ranks and all(isinstance(r, int) for r in ranks):
        return ranks
    return None


class _Sites:
    """Interns call sites; frames lists are often shared objects in an unpickled dump."""

    def __init__(self, out: list[str]) -> None:
        self.out = out
        self.by_obj: dict[tuple, int] = {}
        self.is_lib: dict[str, bool] = {}
        self.by_key: dict[tuple, int] = {}
        self.keep: list = []  # keeps the frames objects alive so their ids stay unique
        self.records: list[dict] = []
        self.with_stack = 0

    def get(self, frames) -> int:
        if not isinstance(frames, list) or not frames:
            return self._intern((), None)
        # torch's pickler shares equal frame dicts between entries (memo), not the lists
        okey = tuple(map(id, frames))
        sid = self.by_obj.get(okey)
        if sid is not None:
            return sid
        user, lib = [], []
        is_lib = self.is_lib
        for fr in frames:
            if not isinstance(fr, dict):
                continue
            fn, line, name = str(fr.get("filename", "?")), _int(fr.get("line")), str(fr.get("name", "?"))
            lib_frame = is_lib.get(fn)
            if lib_frame is None:
                lib_frame = is_lib[fn] = _is_library(fn)
            if lib_frame:
                if not user:
                    lib.append((fn, line, name))
            else:
                user.append((fn, line, name))
                if len(user) >= 6:
                    break
        via = None
        lib = [f for f in lib if not (f[0].startswith(_HERE) or "-packages/ddpdoctor/" in f[0])]
        if user and lib:
            fn, line, name = lib[-1]
            if "distributed_c10d" not in fn and "c10d_logger" not in fn:
                via = f"{name} ({os.path.basename(fn)}:{line})"
        sid = self._intern(tuple(user), via)
        self.by_obj[okey] = sid
        self.keep.append(frames)  # keeps the ids in okey from being reused
        return sid

    def _intern(self, user: tuple, via) -> int:
        key = (user, via)
        sid = self.by_key.get(key)
        if sid is not None:
            return sid
        sid = len(self.by_key)
        self.by_key[key] = sid
        stack = [[fn, line, name, linecache.getline(fn, line).strip()] for fn, line, name in user]
        rec: dict = {"t": "site", "id": sid}
        if stack:
            self.with_stack += 1
            rec.update(file=stack[0][0], line=stack[0][1], func=stack[0][2], src=stack[0][3])
        else:
            rec.update(file=NO_STACK, line=0, func="?", src="")
        rec["stack"] = stack
        if via:
            rec["via"] = via
        conds = sourceinfo.conditions_for_stack([(s[0], s[1]) for s in stack]) if stack else []
        if conds:
            rec["conds"] = conds
        self.out.append(_dumps(rec) + "\n")
        self.records.append(rec)
        return sid


def _shape(v: tuple, pg_id) -> tuple:
    """(group, op, elements, encoded middle of the ``c`` line, encoded group) of an entry whose
    fields (``_NAMES``) are ``v``; ``pg_id``: its ``pg_id``, "0" when it has none."""
    g, _desc = _pg(v[1], pg_id)
    pn = str(v[0])
    base = pn.split(":", 1)[1] if ":" in pn else pn
    base = base.split(" ", 1)[0]
    op = _OPS.get(base, base)
    x, n = _tensors(v[3], v[4])
    xo, _ = _tensors(v[5], v[6])
    sig = (op + "|" + signature({"op": op, "x": x})).encode()  # what load.read_rank digests
    return (g, op, n, f'"op":{_dumps(op)},"x":{_dumps(x)},"n":{n},"xo":{_dumps(xo)},', _dumps(g),
            op.encode(), sig)


#: Entry fields read with one C call (itemgetter); an entry lacking one is read field by field.
#: The first ``_KEYED`` decide everything about an entry's line but its position and times.
_NAMES = ("profiling_name", "process_group", "pg_id", "input_sizes", "input_dtypes", "output_sizes",
          "output_dtypes", "state", "retired", "time_created_ns", "time_discovered_completed_ns",
          "collective_seq_id", "is_p2p")
_KEYED = 9
_FIELDS = itemgetter(*_NAMES)
_FIELDS_FRAMES = itemgetter(*_NAMES, "frames")  # dumps with stacks: every entry has its frames
_QUESTION = frozenset({"profiling_name", "state"})  # read with a "?" default
# indices of a kind's fields (see _Pass.kind)
_K_OP, _K_SID, _K_OPB, _K_SIGB, _K_BAR, _K_DS, _K_P2P, _K_NAME = 1, 3, 9, 10, 11, 12, 14, 15


def _fields_slow(e: dict) -> tuple:
    return tuple(e.get(k, "?" if k in _QUESTION else None) for k in _NAMES) + (e.get("frames"),)


def _plain_stack(frames: list) -> bool:
    """Whether every frame is a dict with a str filename and name and an int line: then a frames
    list equal to this one (``==``) names the same call site (no 1 == True == 1.0 between values
    whose text differs), so a stack can be recognised by comparison."""
    return all(type(f) is dict and type(f.get("filename")) is str and type(f.get("name")) is str
               and type(f.get("line")) is int for f in frames)


class _Pass:
    """One pass over a dump's entries (oldest first): the ``c`` / ``p`` lines and what
    load.read_rank would compute from them (a test keeps the two equal).

    Entries that agree on the ``_KEYED`` fields and on their frames are one *kind*: its group,
    op, encoded line parts, call site and completion are worked out once, and each entry adds only
    its position and times. Real dumps hold a handful of kinds (a training loop repeats its calls),
    so most of an entry's cost is reading its fields. Per-group digests and per-op counters are
    summed once at the end (:meth:`finish`) from the kinds, not entry by entry."""

    def __init__(self, sites: _Sites, members: dict, gloo: bool, t0: int, world: int, rt: RankTrace) -> None:
        self.sites, self.members, self.gloo, self.t0, self.world, self.rt = sites, members, gloo, t0, world, rt
        self.kinds: dict[tuple, list] = {}
        self.body: list[str] = []
        self.incomplete = 0
        self.stuck: dict[str, list] = {}
        self.order: list[list] = []  # kinds in the order of their first collective
        self.gorder: list[str] = []  # groups in the order of their first collective
        self.gacc: dict[str, list] = {}  # group -> [(seq, offset in the body, kind)]
        self.channels: dict[tuple, int] = {}

    def kind(self, e: dict | None, v: tuple, sid: int) -> list:
        """The kind of an entry seen for the first time: [group, op, complete, site, state, world
        hint, the group's events, three parts of its ``c`` line, op and signature bytes (digests),
        barrier, durations of its collectives, p2p parts (worked out when first needed), name]."""
        pn, state, retired = v[0], v[7], v[8]
        # rows of the C reader (e None) always have a pg_id (frnative.REQUIRED)
        shape = _shape(v, v[2] if e is None else e.get("pg_id", "0"))
        g, op, n, mid, gj, op_b, sig_b = shape
        # gloo never moves state past "scheduled": there, a retired entry is a finished work
        complete = state == "completed" or (bool(retired) and (self.gloo or state not in ("scheduled", "started")))
        tail = f',"fr":{_dumps(str(state))}' + ("" if complete else ',"pending":1')
        wc = 0  # the world size an all_gather of the default group tells
        if g == "0" and n and op in ("all_gather", "all_gather_into_tensor"):
            _xo, nout = _tensors(v[5], v[6])
            if nout and nout % n == 0:
                wc = nout // n
        ga = self.gacc.get(g)
        if ga is None:
            ga = self.gacc[g] = []
        return [g, op, complete, sid, str(state), wc, ga, f'{{"t":"c","g":{gj},"s":', f',{mid}"ts":',
                op_b, sig_b, op in BARRIER_OPS, [], f',"site":{sid}{tail}}}\n', None, (pn, gj, tail)]

    def p2p(self, kind: list, v: tuple) -> tuple | None:
        """A p2p kind's channel and line parts; None when its name tells no channel."""
        g, op, sid = kind[0], kind[_K_OP], kind[_K_SID]
        pn, gj, tail = kind[_K_NAME]
        meta = pn.split(" ", 1)[1] if isinstance(pn, str) and " " in pn else ""
        m, mr = _SEND.match(meta), _RECV.match(meta)
        if not (m or mr):
            return None
        a, b = (int(m.group(1)), int(m.group(2))) if m else (int(mr.group(2)), int(mr.group(1)))
        ranks = self.members.get(g)
        if ranks:  # group ranks -> global ranks
            a = ranks[a] if a < len(ranks) else a
            b = ranks[b] if b < len(ranks) else b
        ch = f"{a}>{b}"
        x, n = _tensors(v[3], v[4])
        return ((g, ch), f'{{"t":"p","op":{_dumps(op)},"g":{gj},"ch":"{ch}","s":',
                f',"x":{_dumps(x)},"n":{n},"ts":', f',"site":{sid}{tail}}}\n', f"{g}:{ch}", ("t|" + str(x)).encode())

    def run(self, entries: list, native: tuple | None = None) -> None:
        """``entries``: dicts, or with ``native`` = (kinds, stacks, pairs) the rows of frnative.read."""
        kinds, body, stuck, rt, sites = self.kinds, self.body, self.stuck, self.rt, self.sites
        if native is not None:
            kvals, svals, pairs = native
            ssids = [-1] * len(svals)
            bypair: list = [None] * len(pairs)
        stacks: dict[int, list] = {}  # id of a stack's first frame -> [(frames, site id)]
        order, gorder, t0, world = self.order, self.gorder, self.t0, self.world
        fields = _FIELDS_FRAMES
        kp = frdump.KeyPickler()
        dump, parts, pop = kp.pickler.dump, kp.parts, kp.parts.pop
        if entries and "frames" not in entries[0]:
            fields = _FIELDS
        append = body.append
        rel = 0  # byte offset of the next line in the body
        incomplete = last_ts = 0
        for e in entries:
            if native is not None:
                # the C reader told the entry's kind and stack apart already: look up their first
                pidx, created, done, seq, p2p, dm, p2ps, _rid = e
                kind = bypair[pidx]
                if kind is None:
                    kidx, stidx = pairs[pidx]
                    sid = ssids[stidx]
                    if sid < 0:
                        sid = ssids[stidx] = sites.get(svals[stidx])
                    kind = bypair[pidx] = kinds.get((kidx, sid))
                    if kind is None:
                        kind = bypair[pidx] = kinds[(kidx, sid)] = self.kind(None, kvals[kidx], sid)
            else:
                try:
                    v = fields(e)
                    frames = v[-1] if fields is _FIELDS_FRAMES else e.get("frames")
                except KeyError:
                    v = _fields_slow(e)
                    frames = v[-1]
                if isinstance(frames, list) and frames:
                    # torch's pickles share equal frame dicts (memo): an entry's stack is, object for
                    # object, the frames list of an earlier entry; == checks identity first, and only
                    # stacks whose equal frames name the same site (_plain_stack) are compared so
                    sid = -1
                    for ref, s in stacks.get(id(frames[0]), ()):
                        if ref == frames:
                            sid = s
                            break
                    if sid < 0:
                        sid = sites.get(frames)
                        if _plain_stack(frames):
                            stacks.setdefault(id(frames[0]), []).append((frames, sid))
                else:
                    sid = sites.get(frames)
                try:
                    dump(v[:_KEYED])
                    kb = pop()
                    if parts:  # a large value, written in parts
                        parts.append(kb)
                        kb = b"".join(parts)
                        parts.clear()
                    kk = (kb, sid)
                except (RecursionError, ValueError):
                    parts.clear()
                    try:
                        # a cyclic value: the memo's pickle (its MEMOIZE opcodes, which fast mode never
                        # writes, keep the two kinds of key apart)
                        kk = (frdump.encode(v[:_KEYED]), sid)
                    except RecursionError:  # absurdly nested values: told apart by their repr
                        kk = (tuple(map(repr, v[:_KEYED])), sid)
                kind = kinds.get(kk)
                if kind is None:
                    kind = kinds[kk] = self.kind(e, v, sid)
                created, done, seq, p2p = v[_KEYED:_KEYED + 4]
            g, _op, complete, sid, state, wc, ga, pre, mid, _ob, _sb, _bar, ds, post, _p2p, _pn = kind
            created = created if isinstance(created, int) else 0
            ts = (created - t0) // 1000 if created > t0 else 0
            d = (done - created) // 1000 if isinstance(done, int) and done > created > 0 else 0
            if not d:
                if native is None:
                    dm = e.get("duration_ms")
                if isinstance(dm, (int, float)) and dm > 0:
                    d = int(dm * 1000)
            if not complete:
                incomplete += 1
            seq = seq if isinstance(seq, int) else 0
            if p2p or (seq == 0 and _int(e.get("p2p_seq_id") if native is None else p2ps) > 0):
                pk = kind[_K_P2P]
                if pk is None:
                    if native is not None:
                        v = kvals[pairs[pidx][0]]
                    pk = kind[_K_P2P] = self.p2p(kind, v) or ()
                if not pk:
                    continue
                chkey, ppre, pmid, ppost, pkey, psig = pk
                k = self.channels[chkey] = self.channels.get(chkey, 0) + 1
                line = f'{ppre}{k}{pmid}{ts},"d":{d}{ppost}'
                append(line)
                rel += len(line)
                ent = rt.p2p.get(pkey)
                if ent is None:
                    rt.p2p[pkey] = [1, zlib.crc32(psig), json.loads(line)]
                else:
                    ent[0] += 1
                    ent[1] = zlib.crc32(psig, ent[1])
                if ts + d > last_ts:
                    last_ts = ts + d
                continue
            if seq <= 0:
                continue
            if not complete and g not in stuck:  # the oldest unfinished collective of the group
                stuck[g] = [seq, _op, sid, state]
            if wc and not world:
                world = wc
            line = f'{pre}{seq}{mid}{ts},"d":{d}{post}'
            append(line)
            if not ds:
                order.append(kind)
            ds.append(d)
            if not ga:
                gorder.append(g)
            ga.append((seq, rel, kind))
            rel += len(line)
            if ts + d > last_ts:
                last_ts = ts + d
        self.incomplete, self.world = incomplete, world
        rt.last_ts = last_ts

    def finish(self) -> tuple[dict, list[str]]:
        """Fill the RankTrace's per-group digests and counters; returns the groups' spans
        ({group: [first seq, last seq, count]}) and the gaps inside them, in entry order."""
        rt = self.rt
        rt.events = len(self.body)
        groups: dict[str, list[int]] = {}
        gaps: list[tuple] = []
        pairs: list[tuple] = []
        crc = zlib.crc32
        # the byte offsets (from the block's start) of each group's events in its last digest block,
        # where a hang shows: the aligner reads the event it compares there with one seek instead
        # of decoding the block up to it on every rank (frmodel.block_offsets); ~1 KB a rank
        last_block: dict[str, tuple[int, array]] = {}
        rt.last_block = last_block  # type: ignore[attr-defined] - travels with the RankTrace
        for g in self.gorder:
            seqs, rels, kl = zip(*self.gacc[g])
            n = len(seqs)
            groups[g] = [seqs[0], seqs[-1], n]
            diffs = list(map(sub, seqs[1:], seqs))
            if diffs.count(1) != n - 1:
                gaps.extend((rels[i], f"group {g}: #{seqs[i - 1]} then #{seqs[i]}")
                            for i, dd in enumerate(diffs, 1) if dd != 1)
            gs = rt.groups[g] = GroupStream(count=n)
            opbs, sigbs = list(map(itemgetter(_K_OPB), kl)), list(map(itemgetter(_K_SIGB), kl))
            for i in range(0, n, BLOCK):  # a block's digest is the crc32 of its events' bytes in a row
                gs._op, gs._sig = crc(b"".join(opbs[i:i + BLOCK])), crc(b"".join(sigbs[i:i + BLOCK]))
                gs.blocks.append([gs._op, gs._sig, rels[i]])  # relative to the body
            pairs.extend((rels[i], (kl[i - 1][_K_SID], kl[i][_K_OP]))
                         for i in compress(range(1, n), map(itemgetter(_K_BAR), kl)))
            rt.last_op[g] = (kl[-1][_K_OP], kl[-1][_K_SID])
            lb = (n - 1) // BLOCK
            try:
                last_block[g] = (lb, array("I", [r - rels[lb * BLOCK] for r in rels[lb * BLOCK:]]))
            except OverflowError:  # a block over 4 GiB: the aligner decodes it as for any trace
                pass
        pairs.sort(key=itemgetter(0))
        ab = rt.after_barrier
        for _rel, k in pairs:
            ab[k] = ab.get(k, 0) + 1
        waits, op_sites = rt.waits, rt.op_sites
        for kind in self.order:
            op, ds = kind[_K_OP], kind[_K_DS]
            c, total, longest = len(ds), sum(ds), max(ds)
            w = waits.get(op)
            if w is None:
                waits[op] = [c, total, longest]
            else:
                w[0] += c
                w[1] += total
                w[2] = max(w[2], longest)
            w = op_sites.get((op, kind[_K_SID]))
            if w is None:
                op_sites[(op, kind[_K_SID])] = [c, total]
            else:
                w[0] += c
                w[1] += total
        gaps.sort(key=itemgetter(0))
        return groups, [t for _rel, t in gaps]


def convert(job: tuple[str, str, str]) -> dict:
    """Convert one dump (``(source path, kind, output path)``) into a trace file. Returns a summary:
    ``rank``, ``groups`` ({group: [first seq, last seq, count]}), ``world`` (a hint, 0 unknown),
    ``notes``; ``skip`` when the file is not a dump; ``refused`` for a hostile pickle."""
    gc_was = gc.isenabled()
    # a dump is ~100,000 containers without cycles, alive while it is converted: collections
    # (which would walk them again and again) only cost time; it is freed by reference counting
    gc.disable()
    try:
        return _convert(job)
    finally:
        if gc_was:
            gc.enable()


def _convert(job: tuple[str, str, str]) -> dict:
    src, kind, out = job
    summary: dict = {"src": src, "out": out, "notes": []}
    # the C reader first (plain pickles only; None: anything else, read by the restricted unpickler)
    fast = frnative.read(src) if kind == "pickle" else None
    try:
        dump = fast[0] if fast is not None else frdump.read(src, kind)
    except frdump.DumpRefused as exc:
        summary["refused"] = str(exc)
        return summary
    if dump is None:
        summary["skip"] = True
        return summary
    rank = frdump.rank_of(src, dump)
    if rank is None:
        summary["notes"].append(f"{os.path.basename(src)}: a Flight Recorder dump whose rank is unknown "
                                "(torch names them <prefix><rank>; rename it so); ignored")
        summary["skip"] = True
        return summary
    summary["rank"] = rank
    if fast is not None:
        _head, entries, kvals, svals, pairs, ordered = fast
        if not ordered:  # every record_id is an int here
            entries.sort(key=itemgetter(7))
        pns = (kvals[pairs[row[0]][0]][0] for row in entries)  # read up to the first with a backend
        created = map(itemgetter(1), entries)
    else:
        entries = [e for e in dump.get("entries") or [] if isinstance(e, dict)]
        try:
            entries.sort(key=itemgetter("record_id"))  # oldest first (normally already so)
        except (KeyError, TypeError):
            entries.sort(key=lambda e: _int(e.get("record_id")))
        pns = map(methodcaller("get", "profiling_name", ""), entries)
        created = map(methodcaller("get", "time_created_ns"), entries)
    pg_config = dump.get("pg_config") if isinstance(dump.get("pg_config"), dict) else {}
    members: dict[str, list[int]] = {}
    for key, cfg in pg_config.items():
        ranks = _ranks_of(cfg)
        name = str(cfg.get("name") or key) if isinstance(cfg, dict) else str(key)
        if ranks is not None and name:
            members[name] = ranks
    backend = "?"
    for pn in pns:
        pn = str(pn)
        if ":" in pn:
            backend = pn.split(":", 1)[0]
            break
    gloo = backend == "gloo"
    # entries are in creation order: the first timestamp is the origin (an earlier one clamps to 0)
    t0 = next((c for c in created if isinstance(c, int) and c > 0), 0)
    lines: list[str] = []
    sites = _Sites(lines)
    world = len(members.get("0", [])) if "0" in members else 0
    rt = RankTrace(path=out)
    entry_pass = _Pass(sites, members, gloo, t0, world, rt)
    entry_pass.run(entries, None if fast is None else (kvals, svals, pairs))
    groups, gaps = entry_pass.finish()
    world, incomplete, stuck, body = entry_pass.world, entry_pass.incomplete, entry_pass.stuck, entry_pass.body
    tail_lines = body[-FR_TAIL:]
    pg_status = dump.get("pg_status") if isinstance(dump.get("pg_status"), dict) else {}
    status = {str(k): {kk: _int(vv, -1) for kk, vv in v.items()} for k, v in pg_status.items()
              if isinstance(v, dict)}
    header = {"t": "header", "schema": 1, "tool": "ddpdoctor", "source": "flight-recorder",
              "run": RUN_ID, "rank": rank, "world": world, "attempt": 0, "backend": backend,
              "torch": f"? (FR format {dump.get('version', '?')})",
              "wall0": t0 / 1e9, "pg_timeout_s": None, "hang_timeout_s": 0,
              "fr": {"file": os.path.abspath(src), "form": kind, "version": str(dump.get("version", "")),
                     "entries": len(entries), "stacks": sites.with_stack > 0, "pg_status": status,
                     "groups": groups, "incomplete": incomplete, "stuck": stuck}}
    pg_recs = [{"t": "pg", "op": "new_group", "g": name, "ranks": ranks}
               for name, ranks in members.items() if name != "0"]
    head = _dumps(header) + "\n"
    pgs = [_dumps(r) + "\n" for r in pg_recs]
    try:
        # ASCII only (json.dumps escapes the rest), so a line's length is its size in bytes
        with open(out, "w", encoding="ascii") as f:
            f.write(head)
            f.writelines(pgs)
            f.writelines(lines)  # site records precede every event (sites are read first)
            f.writelines(body)
    except (OSError, UnicodeEncodeError) as exc:
        summary["notes"].append(f"{os.path.basename(src)}: cannot convert ({exc}); ignored")
        summary["skip"] = True
        return summary
    prefix = len(head) + sum(map(len, pgs)) + sum(map(len, lines))
    for gs in rt.groups.values():
        for blk in gs.blocks:
            blk[2] += prefix
    rt.header = json.loads(head)
    for r in pg_recs:
        rt.rare.append(json.loads(_dumps(r)))
        rt.header.setdefault("_groups", {})[r["g"]] = r["ranks"]
    rt.sites = {r["id"]: json.loads(_dumps(r)) for r in sites.records}
    rt.tail = deque((json.loads(x) for x in tail_lines), maxlen=FR_TAIL)
    summary["trace"] = rt
    if gaps:
        summary["notes"].append(f"{os.path.basename(src)} (rank {rank}): entries missing inside the "
                                f"buffer ({'; '.join(gaps[:3])}); positions after a gap are compared as if contiguous")
    summary.update(groups=groups, world=world, entries=len(entries), stacks=sites.with_stack > 0,
                   form=kind, backend=backend)
    return summary
