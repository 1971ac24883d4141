"""The repeat call of a collective from a call site already seen: the lean path of ``dist``.

Profiled first (callgrind, bench/instructions.py; bytecodes counted with ``sys.settrace``):
the general path (``dist._record``) ran ~360 bytecodes of ddpdoctor per one-element
``all_reduce``, ~35k instructions next to the ~62k of the call itself, with no single hot spot:
a call-site lookup, the argument key, two f-strings and their UTF-8 encoding, the in-flight
slot's method call, two named-tuple-like records, two audited frame accesses.

Everything that is the same at every call of one call site with arguments of one shape is
computed once, when ``dist`` first sees that (call site, argument key) pair, into a ``Hit``:
the record pre-encoded as bytes around its varying numbers (sequence number, start, duration),
the resolved call-site id, the group's name and the in-flight entry's constant part. A repeat
call then does: one dict lookup, the sequence number, two clock reads, one bytes formatting
for the in-flight slot and one for the record, two stores into mapped memory. Nothing is
deferred: the record is complete in the page cache when the call returns, the in-flight slot
is written before the call is issued, the watchdog's ``inflight`` entry exists during it, so
crash-safety and the hang diagnosis are those of the general path.

The record keeps the general path's field order (``s`` first, then ``ts``, ``d``, ``site``):
``analysis.load`` matches ``c`` lines of one shape with a pattern in that order.
"""

from __future__ import annotations

import inspect
import keyword
import sys
import threading
import time
from typing import NamedTuple

from ...trace.inflight import SIZE as _SLOT_SIZE
from .. import native
from .. import recorder as recorder_mod
from ..callsite import resume_frames as _resume

_perf_ns = time.perf_counter_ns
_get_ident = threading.get_ident
_getframe = sys._getframe
#: An object's identity without id(), which raises an audit event (see callsite).
_identity = object.__hash__


class Hit(NamedTuple):
    """What a repeat call from one call site, with arguments of one shape, records."""

    rec: object  # the recorder the bytes were made for (site ids are its own)
    g: str  # group name
    op: str
    in_seq: bool  # an event in the group's sequence (else its entries carry s=0)
    site: int
    head: bytes  # the record up to the sequence number
    mid: bytes  # after the sequence number, up to the start time's value
    tail: bytes  # after the duration, to the end of the line
    slot_tail: bytes  # the in-flight record after its start time
    is_async: bool
    wtag: str
    ent: tuple  # the general path's cached part (it keeps the key's objects alive)
    code: object  # the caller's code: its identity in the cache key is never reused


def make_hit(rec, ent: tuple, site: int, code) -> Hit | None:
    """The ``Hit`` of a call with cached part ``ent`` (see ``dist._record``) at ``site``;
    None when the line could not fit the in-flight slot (the general path then handles it)."""
    enc = "utf-8", "backslashreplace"  # what the general path encodes the whole line with
    head = ent[1].encode(*enc)
    mid = (ent[2] + ',"ts":').encode(*enc)
    tail = f',"site":{site}{ent[3]}}}\n'.encode(*enc)
    slot_tail = f',"site":{site}}}\n'.encode()
    if len(head) + len(mid) + len(slot_tail) + 48 >= _SLOT_SIZE:
        return None
    return Hit(rec, ent[0], ent[4], ent[5], site, head, mid, tail, slot_tail, ent[6], ent[7], ent, code)


# The C repeat-call path (rank/_fastcall.c), or None: not built or ``DDPDOCTOR_NATIVE=0``; the
# Python ``wrapper`` is then used.
_native = native.load("_fastcall")


def make_wrapper(orig, fastkey, general, reducing: bool, compiling: tuple, shared: tuple,
                 lib: dict | None = None):
    """The wrapper of collective ``orig``: a repeat call from a known site with arguments of a
    known shape is recorded here from its ``Hit``; any other goes to ``general(rec, tid, frame,
    fkey, fast, args, kwargs)``, which records it and stores the ``Hit`` for next time.
    ``compiling``: dist's (is_dynamo_compiling, torch.compiler); ``shared``: dist's
    (_failed, _track_async), passed in so that this module does not import dist. ``lib``: dist's
    (key, user's site) -> Hit of library callers (see libcalls), read by the C path.

    One function for the whole fast path: a Python call and its arguments cost ~1k
    instructions, a tenth of what is left to spend (callgrind)."""
    # (caller's code identity, its instruction offset, its caller's offset, argument key) -> Hit
    fast: dict = {}
    dyn, tc = compiling
    native = _native
    failed, track_async = shared

    def wrapper(*args, **kwargs):
        rec = recorder_mod._recorder
        if rec is None or not rec.enabled or rec.local.depth or dyn() or tc._is_compiling_flag:
            return orig(*args, **kwargs)  # not tracing, nested in a patched call, or compiling
        tid = _get_ident()
        inflight = rec.inflight
        if tid in inflight:  # inside another recorded call (all_gather_object -> all_gather)
            return orig(*args, **kwargs)
        try:
            frame = _resume(None).f_back  # _resume's caller is this frame
        except ValueError:  # another thread is inside the generator right now
            frame = _getframe(1)
        if native is not None:  # called by the C path, called by `shim`: the user's is further out
            frame = frame.f_back
        hit = fkey = None
        if fastkey is not None and not (reducing and rec.ddp_refs):  # (ddp_overlap: general)
            try:
                b = frame.f_back
                fkey = fastkey(args, kwargs, _identity(frame.f_code), frame.f_lasti,
                               -1 if b is None else b.f_lasti)
                hit = fast.get(fkey)
            except (AttributeError, TypeError):  # arguments the key cannot hold
                fkey = None
        if hit is None or hit.rec is not rec:
            return general(rec, tid, frame, fkey, fast, args, kwargs)
        seqs = rec.seq
        g = hit.g
        seq = seqs.get(g, 0) + 1
        seqs[g] = seq
        start = _perf_ns()
        ts = (start - rec.t0_ns) // 1000
        # the line up to its start time, formatted once for both stores (a fifth fewer
        # instructions than formatting each whole line, measured)
        pre = b"%b%d%b%d" % (hit.head, seq, hit.mid, ts)
        slot = rec.slot
        if slot is not None:  # survives the process dying inside the call (see trace/inflight)
            data = pre + hit.slot_tail
            slot._mm[:len(data)] = data  # one store: atomic under the GIL, like slot.set
        iseq = seq if hit.in_seq else 0
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

    if native is None:
        return wrapper
    # The same path in C (rank/_fastcall.c), with `wrapper` for what it does not handle. The
    # function torch.distributed exposes stays a Python function: Dynamo folds dyn() to True
    # in what it traces and then traces torch's own function (it cannot trace into C: with the
    # C object exposed, torch.compile(fullgraph=True) failed on a collective, measured).
    call = native.make(orig, fastkey, general, fast, reducing, tc, failed, track_async, recorder_mod,
                       wrapper, _perf_ns, getattr(fastkey, "plan", ()), None if lib is None else lib,
                       getattr(fastkey, "kwplan", ()))
    shim = _exact_shim(orig, call, dyn, native.Inside(recorder_mod))
    if shim is None:
        def shim(*args, **kwargs):
            if dyn():
                return orig(*args, **kwargs)
            return call(*args, **kwargs)

    shim._ddpdoctor_native = call  # (tests tell the two paths apart by it)
    return shim


#: Keywords torch's c10d exception logger reads from a failing collective's call.
_LOGGED_KEYWORDS = frozenset({"group", "process_group", "pg"})


def _exact_shim(orig, call, dyn, inside=None):
    """The shim with ``orig``'s own parameters (and its very default objects), or None where they
    are not all plain positional-or-keyword ones.

    Session 5 (callgrind): ``def shim(*args, **kwargs)`` cost ~2k instructions a call: a fresh
    C-level interpreter loop for a varargs function, the argument tuple and dict, a merged dict
    for ``call(*args, **kwargs)``. With named parameters the interpreter runs the shim in its
    own loop and ``call(a, b, c, d)`` is a plain vectorcall. Nothing a caller can tell changes:
    a parameter not passed holds its default, the same object ``orig`` would give it, and a bad
    call raises the TypeError of the same signature under the same name. ``inside``: true while
    this thread is inside a call the C path recorded (``_fastcall.Inside``)."""
    try:
        params = list(inspect.signature(orig).parameters.values())
    except (TypeError, ValueError):
        return None
    name = getattr(orig, "__name__", "")
    reserved = {"_ddpdoctor_orig", "_ddpdoctor_call", "_ddpdoctor_dyn", "_ddpdoctor_inside"}
    if not name.isidentifier() or keyword.iskeyword(name) or not params or any(
            p.kind is not p.POSITIONAL_OR_KEYWORD or keyword.iskeyword(p.name) or p.name in reserved
            for p in params):
        return None
    names: dict = {"_ddpdoctor_orig": orig, "_ddpdoctor_call": call, "_ddpdoctor_dyn": dyn,
                   "_ddpdoctor_inside": False if inside is None else inside}
    sig = []
    for i, p in enumerate(params):
        if p.default is p.empty:
            sig.append(p.name)
        else:
            names[f"_ddpdoctor_d{i}"] = p.default
            sig.append(f"{p.name}=_ddpdoctor_d{i}")
    passed = ", ".join(p.name for p in params)
    # torch's exception logger (`_exception_logger`) reads the group from the call's *keywords*
    # when a collective fails: a group passed positionally changed how a call with an invalid
    # group object failed (tests/faults: AttributeError instead of ValueError). A group left at
    # its default reads the same either way, so that (common) form stays one positional
    # vectorcall; a group given is passed by keyword, with the parameters after it.
    g = next((i for i, p in enumerate(params) if p.name in _LOGGED_KEYWORDS and p.default is not p.empty), None)
    if g is None:
        body = f"    return _ddpdoctor_call({passed})\n"
    else:
        by_kw = ", ".join([p.name for p in params[:g]] + [f"{p.name}={p.name}" for p in params[g:]])
        body = (f"    if {params[g].name} is _ddpdoctor_d{g}:\n"
                f"        return _ddpdoctor_call({passed})\n"
                f"    return _ddpdoctor_call({by_kw})\n")
    # Dynamo folds _ddpdoctor_dyn() to True (it traces torch's function, never reading the
    # flag); _ddpdoctor_inside: nested in a call the C path recorded, which then calls torch's
    # function from here, not through the C path (session 6: ~900 instructions a nested call)
    src = (f"def {name}({', '.join(sig)}):\n"
           f"    if _ddpdoctor_dyn() or _ddpdoctor_inside:\n"
           f"        return _ddpdoctor_orig({passed})\n"
           + body)
    exec(src, names)  # noqa: S102 - source built above from orig's parameter names only
    return names[name]


def key_function(params: list[str], defaults: dict, tensors: tuple, values: tuple, absent: int):
    """A function ``(args, kwargs, code, lasti, caller_lasti) -> tuple``: the cache key of a
    call (its site and what decides its record: each tensor's shape, dtype, device (True for
    the CPU) and the other listed arguments), built in one go.

    Generated for the signature (like ``dist._key_function``), with one branch per number of
    positional arguments for calls without keyword arguments, the common form
    (``all_reduce(t)``): a parameter not passed holds its default, the same at every call, so
    the key names only the passed ones and the branch's tag (``n``). That is ~15 bytecodes for
    ``all_reduce(t)`` where reading all four parameters cost 61. Raises AttributeError/TypeError
    for arguments it cannot key (not a tensor, an unhashable value)."""
    names: dict = {"_identity": object.__hash__}
    keyed = tensors + values
    pos = {p: params.index(p) if p in params else absent for p in keyed}

    def term(p: str, v: str) -> str:
        if p in tensors:
            # `is_cpu or device`: a CPU tensor's device is a new object at every read, ~550
            # instructions with its hash and compare; is_cpu is a shared bool (callgrind)
            return f"{v}.shape, {v}.dtype, {v}.is_cpu or {v}.device"
        if p == "op":  # a pybind enum hashes through a Python-level call: identity instead
            return f"_identity({v})"
        return v

    body = ["def key(args, kwargs, c, a, b):", "    n = len(args)", "    if not kwargs:"]
    plan = []  # the same branches for the C path (_fastcall.c): (position, 0 tensor/1 identity/2 value)
    # a branch for every count of positional arguments up to all of the signature's (8 at most:
    # _fastcall.c's MAXPLAN): the C path's shim passes every parameter (barrier's unkeyed
    # device_ids included), and a count without a branch takes the generic key (~1.5k more)
    top = max([pos[p] for p in keyed if pos[p] < absent], default=-1) + 2
    for n in range(max(top, min(len(params) + 1, 8))):
        terms = [term(p, f"args[{pos[p]}]") for p in keyed if pos[p] < n]
        plan.append(tuple((pos[p], 0 if p in tensors else 1 if p == "op" else 2) for p in keyed if pos[p] < n))
        cond = "if" if n == 0 else "elif"
        body.append(f"        {cond} n == {n}:")
        body.append(f"            return (c, a, b, {n}, {', '.join(terms)})")
    out = []
    for i, p in enumerate(keyed):
        names[f"d{i}"] = defaults.get(p)
        body.append(f"    v{i} = args[{pos[p]}] if n > {pos[p]} else kwargs.get({p!r}, d{i})")
        out.append(term(p, f"v{i}"))
    body.append(f"    return (c, a, b, -1, {', '.join(out)})")
    exec("\n".join(body), names)  # noqa: S102 - source built above from parameter names only
    names["key"].plan = tuple(plan)
    # the last branch for the C path, calls with keyword arguments (FSDP2's): per term, where
    # the argument is (position, else by name, else the default) and how it is keyed
    names["key"].kwplan = tuple((pos[p], 0 if p in tensors else 1 if p == "op" else 2, p, defaults.get(p))
                                for p in keyed)
    return names["key"]
