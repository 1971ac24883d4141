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

import json
import linecache
import os
import re
import zlib
from collections import deque
from operator import itemgetter, methodcaller

from ..trace import sourceinfo
from . import frdump
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


def _pg(entry: dict) -> tuple[str, str]:
    pg = entry.get("process_group")
    if isinstance(pg, (list, tuple)) and pg:
        return str(pg[0]), str(pg[1]) if len(pg) > 1 else ""
    return str(entry.get("pg_id", "0")), ""


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


def _shape(e: dict, pn) -> tuple:
    """(group, op, elements, encoded middle of the ``c`` line, encoded group) of an entry."""
    g, _desc = _pg(e)
    pn = str(pn)
    base = pn.split(":", 1)[1] if ":" in pn else pn
    base = base.split(" ", 1)[0]
    op = _OPS.get(base, base)
    x, n = _tensors(e.get("input_sizes"), e.get("input_dtypes"))
    xo, _ = _tensors(e.get("output_sizes"), e.get("output_dtypes"))
    sig = (op + "|" + signature({"op": op, "x": x})).encode()  # what load.read_rank digests
    return (g, op, n, f'"op":{_dumps(op)},"x":{_dumps(x)},"n":{n},"xo":{_dumps(xo)},', _dumps(g),
            op.encode(), sig)


def convert(job: tuple[str, str, str]) -> dict:
    """Convert one dump (``(source path, kind, output path)``) into a trace file. Returns a summary:
    ``rank``, ``groups`` ({group: [first seq, last seq, count]}), ``world`` (a hint, 0 unknown),
    ``notes``; ``skip`` when the file is not a dump; ``refused`` for a hostile pickle."""
    src, kind, out = job
    summary: dict = {"src": src, "out": out, "notes": []}
    try:
        dump = frdump.read(src, kind)
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
    entries = [e for e in dump.get("entries") or [] if isinstance(e, dict)]
    try:
        entries.sort(key=itemgetter("record_id"))  # oldest first (normally already so)
    except (KeyError, TypeError):
        entries.sort(key=lambda e: _int(e.get("record_id")))
    pg_config = dump.get("pg_config") if isinstance(dump.get("pg_config"), dict) else {}
    members: dict[str, list[int]] = {}
    for key, cfg in pg_config.items():
        ranks = _ranks_of(cfg)
        name = str(cfg.get("name") or key) if isinstance(cfg, dict) else str(key)
        if ranks is not None and name:
            members[name] = ranks
    backend = "?"
    for e in entries:
        pn = str(e.get("profiling_name", ""))
        if ":" in pn:
            backend = pn.split(":", 1)[0]
            break
    gloo = backend == "gloo"
    # entries are in creation order: the first timestamp is the origin (an earlier one clamps to 0)
    t0 = next((c for c in map(methodcaller("get", "time_created_ns"), entries) if isinstance(c, int) and c > 0), 0)
    lines: list[str] = []
    sites = _Sites(lines)
    groups: dict[str, list[int]] = {}
    gaps: list[str] = []
    world = len(members.get("0", [])) if "0" in members else 0
    channels: dict[tuple, int] = {}
    incomplete = 0
    stuck: dict[str, list] = {}
    body: list[str] = []
    rt = RankTrace(path=out)
    streams, waits, op_sites, last_op = rt.groups, rt.waits, rt.op_sites, rt.last_op
    tail_lines: deque = deque(maxlen=FR_TAIL)
    rel = 0  # byte offset of the next line in the body
    crc = zlib.crc32
    # Entries of one shape (group, op, sizes, dtypes) share their encoded middle part.
    shapes: dict[tuple, tuple] = {}
    states: dict[tuple, tuple] = {}
    for e in entries:
        get = e.get
        pn = get("profiling_name", "?")
        pg = get("process_group")
        isz, idt, osz, odt = get("input_sizes"), get("input_dtypes"), get("output_sizes"), get("output_dtypes")
        key = (pn, str(pg), str(isz), str(idt), str(osz), str(odt))
        shape = shapes.get(key)
        if shape is None:
            shape = shapes[key] = _shape(e, pn)
        g, op, n, mid, gj, op_b, sig_b = shape
        created = get("time_created_ns")
        created = created if isinstance(created, int) else 0
        ts = (created - t0) // 1000 if created > t0 else 0
        done = get("time_discovered_completed_ns")
        d = (done - created) // 1000 if isinstance(done, int) and done > created > 0 else 0
        if not d:
            dm = get("duration_ms")
            if isinstance(dm, (int, float)) and dm > 0:
                d = int(dm * 1000)
        sid = sites.get(get("frames"))
        state = get("state", "?")
        skey = (state, get("retired"))
        st = states.get(skey)
        if st is None:
            # gloo never moves state past "scheduled": there, a retired entry is a finished work
            complete = state == "completed" or (bool(skey[1]) and (gloo or state not in ("scheduled", "started")))
            st = states[skey] = (complete, f',"fr":{_dumps(str(state))}' + ("" if complete else ',"pending":1'))
        complete, tail = st
        if not complete:
            incomplete += 1
        seq = get("collective_seq_id")
        seq = seq if isinstance(seq, int) else 0
        if get("is_p2p") or (seq == 0 and _int(get("p2p_seq_id")) > 0):
            meta = pn.split(" ", 1)[1] if isinstance(pn, str) and " " in pn else ""
            m, mr = _SEND.match(meta), _RECV.match(meta)
            if not (m or mr):
                continue
            a, b = (int(m.group(1)), int(m.group(2))) if m else (int(mr.group(2)), int(mr.group(1)))
            ranks = members.get(g)
            if ranks:  # group ranks -> global ranks
                a = ranks[a] if a < len(ranks) else a
                b = ranks[b] if b < len(ranks) else b
            ch = f"{a}>{b}"
            k = channels[(g, ch)] = channels.get((g, ch), 0) + 1
            x, n = _tensors(isz, idt)
            line = (f'{{"t":"p","op":{_dumps(op)},"g":{gj},"ch":"{ch}","s":{k},'
                    f'"x":{_dumps(x)},"n":{n},"ts":{ts},"d":{d},"site":{sid}{tail}}}\n')
            body.append(line)
            rel += len(line)
            rt.events += 1
            pkey = f"{g}:{ch}"
            psig = ("t|" + str(x)).encode()
            ent = rt.p2p.get(pkey)
            if ent is None:
                rt.p2p[pkey] = [1, crc(psig), json.loads(line)]
            else:
                ent[0] += 1
                ent[1] = crc(psig, ent[1])
            tail_lines.append(line)
            if ts + d > rt.last_ts:
                rt.last_ts = ts + d
            continue
        if seq <= 0:
            continue
        if not complete and g not in stuck:  # the oldest unfinished collective of the group
            stuck[g] = [seq, op, sid, str(state)]
        span = groups.get(g)
        if span is None:
            groups[g] = [seq, seq, 1]
        else:
            if seq != span[1] + 1:
                gaps.append(f"group {g}: #{span[1]} then #{seq}")
            span[1] = seq
            span[2] += 1
        if not world and g == "0" and n and op in ("all_gather", "all_gather_into_tensor"):
            _xo, nout = _tensors(osz, odt)
            if nout and nout % n == 0:
                world = nout // n
        line = f'{{"t":"c","g":{gj},"s":{seq},{mid}"ts":{ts},"d":{d},"site":{sid}{tail}}}\n'
        body.append(line)
        # what load.read_rank computes from this line, computed here (a test keeps them equal)
        rt.events += 1
        gs = streams.get(g)
        if gs is None:
            gs = streams[g] = GroupStream()
        if gs.count % BLOCK == 0:
            if gs.count:
                gs.blocks[-1][0], gs.blocks[-1][1] = gs._op, gs._sig
            gs.blocks.append([0, 0, rel])  # relative to the body; the prefix is added at the end
            gs._op = gs._sig = 0
        gs._op = crc(op_b, gs._op)
        gs._sig = crc(sig_b, gs._sig)
        gs.count += 1
        rel += len(line)
        tail_lines.append(line)
        w = waits.get(op)
        if w is None:
            waits[op] = [1, d, d]
        else:
            w[0] += 1
            w[1] += d
            if d > w[2]:
                w[2] = d
        w = op_sites.get((op, sid))
        if w is None:
            op_sites[(op, sid)] = [1, d]
        else:
            w[0] += 1
            w[1] += d
        prev = last_op.get(g)
        if prev is not None and prev[0] in BARRIER_OPS:
            k = (prev[1], op)
            rt.after_barrier[k] = rt.after_barrier.get(k, 0) + 1
        last_op[g] = (op, sid)
        if ts + d > rt.last_ts:
            rt.last_ts = ts + d
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
    for gs in streams.values():
        if gs.blocks:
            gs.blocks[-1][0], gs.blocks[-1][1] = gs._op, gs._sig
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
