"""The repeat call of a collective issued by library code: FSDP's all-gathers and
reduce-scatters, DDP's internals, any caller whose module is plain library code (torch).

``fastpath`` caches a call by its immediate caller's (code, instruction offset): right for a
user's line, wrong for a library line, which is reached from many user lines (FSDP2's
``foreach_all_gather`` runs in the forward, ``model(x)``, and again in the backward,
``loss.backward()``), each its own call site. So library callers took ``dist``'s general path
at every call: the argument key and cache, a second key for the site, the record formatted
from text (~390 bytecodes a collective, counted with ``sys.settrace``; an FSDP2 step is six).

Here the site is looked up first, by ``SiteTable.at`` (the user's frame further out, library
frames passed over in C, see callsite), and the cached ``Hit`` is keyed by the fast path's key
*and* that site: the same record as the general path writes for that (caller, arguments,
site), pre-encoded, replayed with what ``fastpath`` does for a user's call. A new site or new
arguments miss, and the general path records the call and stores its ``Hit`` here.

Where the C path is built and on (rank/_fastcall.c, ``lib_hit``), it makes the same lookup
itself (the caller's globals, ``SiteTable.at``, the same table) and records a ``Hit`` found
with the code of a user's repeat call: ``replay`` below is then the path of ``DDPDOCTOR_NATIVE=0``
(and of a call the C path hands to the general path for an object of an unexpected type).
"""

from __future__ import annotations

import time

_perf_ns = time.perf_counter_ns


def replay(hit, rec, tid: int, orig, args, kwargs, failed, track_async):
    """Issue ``orig(*args, **kwargs)`` once, recorded from ``hit`` (``fastpath.Hit``): the
    sequence number, the in-flight slot before the call, the watchdog's entry during it, the
    record after it. ``failed``/``track_async``: dist's, as for the fast path."""
    seqs = rec.seq
    g = hit.g
    seq = seqs.get(g, 0) + 1
    seqs[g] = seq
    start = _perf_ns()
    ts = (start - rec.t0_ns) // 1000
    pre = b"%b%d%b%d" % (hit.head, seq, hit.mid, ts)  # the line up to its start, shared by both stores
    slot = rec.slot
    if slot is not None:  # survives the process dying inside the call (see trace/inflight)
        data = pre + hit.slot_tail
        slot._mm[:len(data)] = data  # one store: atomic under the GIL, like slot.set
    iseq = seq if hit.in_seq else 0
    inflight = rec.inflight
    inflight[tid] = (hit.op, g, iseq, hit.site, ts)
    try:
        result = orig(*args, **kwargs)
    except BaseException as exc:
        inflight.pop(tid, None)
        # (text and ints only: formatting cannot raise and replace the user's exception)
        failed(rec, exc, f'{hit.ent[1]}{seq}{hit.ent[2]},"ts":{ts}', hit.site, start, (hit.op, g, iseq, ts))
        raise
    try:
        del inflight[tid]
        dur = (_perf_ns() - start) // 1000
        data = b'%b,"d":%d%b' % (pre, dur, hit.tail)
        try:
            rec.writer.mm.write(data)  # the mapped trace file: a memcpy, no syscall
        except (AttributeError, ValueError):  # a full chunk, a plain writer, no file (yet)
            rec.emit_bytes(data)
        rec.events += 1
        rec.last_event = (hit.op, g, iseq, hit.site, ts + dur)
        if hit.is_async and result is not None:
            track_async(rec, result, hit.op, g, iseq, hit.site, hit.wtag)
    except Exception as exc:  # after the call: recorded as far as it went, never re-issued
        rec.internal_error(exc)
    return result
