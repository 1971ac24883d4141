"""Wrappers around the public functions of ``torch.distributed``.

Each wrapper records one event and calls the original with the very same arguments, returning
its value and letting its exception propagate untouched. Several public functions call others
by module-global name (``all_gather_object`` -> ``all_gather``); a thread-local depth counter
makes only the outermost call an event. Both ``torch.distributed.X`` and
``torch.distributed.distributed_c10d.X`` are replaced, since the former is a re-export.
"""

from __future__ import annotations

import functools
import inspect
import json
import sys
import threading
import time
import weakref

from ...trace import ops
from .. import describe
from .. import recorder as recorder_mod
from . import WRAPPED, fastpath, libcalls

_PATCHED_MARK = WRAPPED
_get_ident = threading.get_ident
_perf_ns = time.perf_counter_ns
_getframe = sys._getframe
#: An object's identity without id(), which raises an audit event (see callsite).
_identity = object.__hash__


# Whether torch.compile or export is tracing: a Python side effect there would break its graph.
# ``torch.compiler.is_compiling()`` is two Python calls (~2k instructions a collective, measured
# with callgrind); ``is_dynamo_compiling()`` is one and Dynamo folds it to True while tracing,
# so the flag behind is_compiling (set by export and by compile sessions) is read only eagerly.
try:
    import torch.compiler as _tc

    _dyn = _tc.is_dynamo_compiling
    _tc._is_compiling_flag  # noqa: B018 - present in this torch
except (ImportError, AttributeError):  # older torch
    import types

    _tc = types.SimpleNamespace(_is_compiling_flag=False)
    try:
        from torch.compiler import is_compiling as _dyn
    except ImportError:
        def _dyn() -> bool:
            return False


def _compiling() -> bool:
    return _dyn() or _tc._is_compiling_flag

# op -> (primary tensor params, other tensor params, root params, object params)
# "primary" tensors are those every rank passes with the same metadata in a correct program.
COLLECTIVES: dict[str, tuple[tuple, tuple, tuple, tuple]] = {
    op.name: (op.primary, op.other, op.roots, op.objects) for op in ops.COLLECTIVES}
# op -> (tensor/object param, peer params, direction)
P2P: dict[str, tuple[str, tuple, str]] = {
    op.name: ((op.primary or op.objects)[0], op.peer, op.direction) for op in ops.P2P}
_REDUCING = ops.CHANGING_TENSORS


def _arg_getter(params: list[str], defaults: dict[str, object]):
    index = {p: i for i, p in enumerate(params)}

    def get(name: str, args: tuple, kwargs: dict):
        i = index.get(name)
        if i is not None and i < len(args):
            return args[i]
        return kwargs.get(name, defaults.get(name))

    return get


def _signature(fn) -> tuple[list[str], dict[str, object]]:
    sig = inspect.signature(fn)
    params = [p for p in sig.parameters if sig.parameters[p].kind in
              (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    defaults = {k: v.default for k, v in sig.parameters.items()
                if v.default is not inspect.Parameter.empty}
    return params, defaults


def _failed(rec, exc: BaseException, begin: str, site, start: int, key: tuple) -> None:
    """Record a call that raised. Called from the wrapper's ``except`` block, so it must never
    raise itself: the user's exception propagates unchanged and unchained."""
    try:
        rec.last_failed = key  # a hang that ends in an error is no "resolved"
        err = json.dumps(f"{type(exc).__name__}: {exc}"[:500])
        rec.emit_line(f'{begin},"d":{(_perf_ns() - start) // 1000},"site":{site},"err":{err}}}')
    except Exception as exc2:  # noqa: BLE001 - bookkeeping must not replace the user's error
        rec.internal_error(exc2)


def _record(rec, ent: tuple, seq: int, orig, args, kwargs, frame, tid: int, extra: str = ""):
    """Issue the user's call exactly once, recorded. Shared by every wrapper.

    ``ent`` is what the call's arguments decide, encoded once and cached by the wrapper:
    ``(group name, record text up to the sequence number, text after it, text after the site,
    op, in the group's sequence?, async?, p2p message tag, objects the cache key refers to)``.

    Profiled with callgrind (bench/instructions.py, docs in bench/README.md): the former path
    cost ~70k instructions next to a ~60k-instruction 1-element gloo all_reduce: the call-site
    walk (every ``f_code`` is an audit event), two in-flight records, a ``write`` syscall per
    record, thread-local bookkeeping and formatting helpers. Here: a call-site lookup keyed by
    instruction offsets, three f-strings over cached text, one store into the in-flight slot
    and one into the mapped trace file (mappedtrace.py), no syscall. Nesting is told by this
    thread's entry in ``rec.inflight`` (which the watchdog needs anyway), not a thread-local."""
    # The call site, SiteTable.at inlined for the common hit (a user frame calling torch).
    b = frame.f_back
    sid = rec.sites._at.get((_identity(frame.f_code), frame.f_lasti, -1 if b is None else b.f_lasti))
    site = rec.sites.at(frame) if sid is None else sid
    start = _perf_ns()
    ts = (start - rec.t0_ns) // 1000
    begin = f'{ent[1]}{seq}{ent[2]}{extra},"ts":{ts}'
    slot = rec.slot
    if slot is not None:  # survives the process dying inside the call (see inflightfile)
        slot.set(f'{begin},"site":{site}}}')
    gname, op, iseq = ent[0], ent[4], seq if ent[5] else 0
    inflight = rec.inflight
    inflight[tid] = (op, gname, iseq, site, ts)
    try:
        result = orig(*args, **kwargs)
    except BaseException as exc:
        inflight.pop(tid, None)
        _failed(rec, exc, begin, site, start, (op, gname, iseq, ts))
        raise
    try:
        del inflight[tid]
        dur = (_perf_ns() - start) // 1000
        data = f'{begin},"d":{dur},"site":{site}{ent[3]}}}\n'.encode("utf-8", "backslashreplace")
        try:
            rec.writer.mm.write(data)  # the mapped trace file: a memcpy, no syscall
        except (AttributeError, ValueError):  # a full chunk, a plain writer, no file (yet)
            rec.emit_bytes(data)
        rec.events += 1
        rec.last_event = (op, gname, iseq, site, ts + dur)
        if ent[6] and result is not None:
            _track_async(rec, result, op, gname, iseq, site, ent[7])
    except Exception as exc:  # after the call: recorded as far as it went, never re-issued
        rec.internal_error(exc)
    return result


def _track_async(rec, result, op, gname, seq, site, wtag: str = "") -> None:
    """Remember issued async work until its ``wait()``. ``wtag`` (p2p only) is the JSON fields
    that name the message in the ``w`` record (``"ch":..,"s":..``); p2p keep seq 0 here, as
    they are in no group's sequence."""
    works = result if isinstance(result, list) else [result]
    pending = rec.async_pending
    if not _WAIT[3] and _WAIT[0] is not None:
        _wait_installed(True)
    for w in works:
        key = _identity(w)  # not id(): an audit event (a Python call into every audit hook)

        def forget(ref, key=key):
            # Work dropped without wait(): forget it before its id can be reused by a new
            # Work, whose wait() would otherwise be taken for this one.
            info = pending.get(key)
            if info is not None and info[5] is ref:
                pending.pop(key, None)

        try:
            pending[key] = (op, gname, seq, site, wtag, weakref.ref(w, forget))
        except TypeError:  # a work object without weak references: not tracked
            pass


#: Two names for one collective (torch 2.13 added the *_single names): recorded under the
#: established name, so ranks that call different spellings are not taken for divergent.
_CANONICAL = ops.CANONICAL


#: Parameters that hold one tensor (every other tensor parameter holds a list).
_ONE_TENSOR = frozenset({"tensor", "input_tensor", "output_tensor", "input", "output"})
_ABSENT = 10 ** 6  # the position of a parameter that is never positional


def _key_function(params: list[str], defaults: dict, tensors: tuple, values: tuple):
    """A function ``(args, kwargs) -> tuple`` of what decides a call's record: each tensor's
    (shape, dtype, device) and the other listed arguments (group, root, reduce op, async_op).

    Generated for the signature, as ``dataclasses`` generates its methods: a loop over the
    parameter names cost more instructions than the rest of the lookup (measured with
    callgrind). It raises AttributeError/TypeError for arguments it cannot key (not a tensor,
    an unhashable value): the caller then describes the call without the cache."""
    names: dict = {"_identity": _identity}
    body = ["def key(args, kwargs):", "    n = len(args)"]
    out = []
    for i, p in enumerate(tensors + values):
        names[f"d{i}"] = defaults.get(p)
        pos = params.index(p) if p in params else _ABSENT
        body.append(f"    v{i} = args[{pos}] if n > {pos} else kwargs.get({p!r}, d{i})")
        if p in tensors:
            out.append(f"v{i}.shape, v{i}.dtype, v{i}.device")
        elif p == "op":  # a pybind enum hashes through a Python-level call: identity instead
            out.append(f"_identity(v{i})")                # (the entry keeps the object alive)
        else:
            out.append(f"v{i}")
    body.append(f"    return ({', '.join(out)}{',' if out else ''})")
    exec("\n".join(body), names)  # noqa: S102 - source built above from parameter names only
    return names["key"]


def _field(fn, *a) -> str | None:
    """One optional field of a record: None when the user's argument cannot be described
    (``broadcast(src="a")``): the call is then recorded without it, and torch alone reports
    the bad argument."""
    try:
        return fn(*a)
    except Exception:  # noqa: BLE001 - any user value may be passed here
        return None


def _make_collective(op: str, orig, spec):
    primary, other, roots, objs = spec
    op = _CANONICAL.get(op, op)
    params, defaults = _signature(orig)
    get = _arg_getter(params, defaults)
    has_group = "group" in params or "group" in defaults
    has_async = "async_op" in params
    has_op = op in _REDUCING and op != "broadcast"
    reducing = op in _REDUCING
    from torch.distributed import distributed_c10d as c10d

    non_member = c10d.GroupMember.NON_GROUP_MEMBER
    keyable = not objs and all(p in _ONE_TENSOR for p in primary + other)
    values = (("group",) if has_group else ()) + roots + (("op",) if has_op else ()) + \
        (("async_op",) if has_async else ())
    keyfn = _key_function(params, defaults, primary + other, values) if keyable else None
    fastkey = fastpath.key_function(params, defaults, primary + other, values, _ABSENT) if keyable else None
    cache: dict = {}
    lib: dict = {}  # (fast path key, site) -> Hit, for library callers (libcalls.py)

    def entry(rec, args, kwargs):
        """The call's cached part (see _record), or False for a call that is not recorded.
        Every field that fails to describe is left out; nothing here raises for bad input."""
        group = get("group", args, kwargs) if has_group else None
        if group is non_member:
            return False
        gname = "0" if group is None else rec.group_name(group)
        parts = []
        if primary:
            xs: list[str] = []
            n = 0
            for p in primary:
                d = _field(describe.tensors_desc, get(p, args, kwargs))
                if d is not None:
                    xs.extend(d[0])
                    n += d[1]
            parts.append(f'"x":[{",".join(xs)}],"n":{n}')
        if has_op:
            r = _field(describe.redop_name, get("op", args, kwargs))
            parts.append(f'"rop":"{r if r is not None else "?"}"')
        for r in roots:
            v = _field(lambda x: None if x is None else int(x), get(r, args, kwargs))
            if v is not None:
                parts.append(f'"{"root" if r in ("src", "dst") else "groot"}":{v}')
        if other:
            xo: list[str] = []
            for p in other:
                d = _field(describe.tensors_desc, get(p, args, kwargs))
                if d is not None:
                    xo.extend(d[0])
            parts.append(f'"xo":[{",".join(xo)}]')
        for p in objs:
            v = get(p, args, kwargs)
            if p == "object_list" or p == "scatter_object_output_list":
                k = _field(lambda x: len(x) if x is not None else 0, v)
                if k is not None:
                    parts.append(f'"nobj":{k}')
            else:
                d = _field(describe.object_desc, (v,))
                if d is not None:
                    parts.append(f'"obj":{d}')
        is_async = bool(_field(bool, get("async_op", args, kwargs))) if has_async else False
        post = "".join("," + x for x in parts)
        return (gname, f'{{"t":"c","op":"{op}","g":"{gname}","s":', post,
                ',"async":1' if is_async else "", op, True, is_async, "",
                get("op", args, kwargs) if has_op else None)

    def general(rec, tid, frame, fkey, fast, args, kwargs):
        """A call the fast path (fastpath.make_wrapper) has no ``Hit`` for: described, recorded,
        and its ``Hit`` stored under ``fkey`` for the next call from this site."""
        gk = rec.sites._gkind.get(_identity(frame.f_globals))
        lsite = None
        if fkey is not None and gk is not None and gk[1]:
            # a library caller (FSDP, DDP internals): its site is further out; a Hit per
            # (fkey, site) replays what this path would record (libcalls.py)
            try:
                lsite = rec.sites.at(frame)
                h = lib.get((fkey, lsite))
            except Exception as exc:  # noqa: BLE001 - never let bookkeeping break the call
                rec.internal_error(exc)
                h = lsite = None
            if h is not None and h.rec is rec:
                return libcalls.replay(h, rec, tid, orig, args, kwargs, _failed, _track_async)
        ent = None
        try:
            if keyfn is not None:
                key = keyfn(args, kwargs)
                ent = cache.get(key)
                if ent is None:
                    ent = entry(rec, args, kwargs)
                    if len(cache) < 4096:
                        cache[key] = ent
            else:
                ent = entry(rec, args, kwargs)
        except (AttributeError, TypeError):  # arguments the key cannot hold: uncached
            ent = None
        except Exception as exc:  # noqa: BLE001 - never let bookkeeping break the call
            rec.internal_error(exc)
            ent = False
        if ent is None:
            ent = _field(entry, rec, args, kwargs)
        if not ent:  # not recorded: issued outside any handler, so nothing is chained to it
            return orig(*args, **kwargs)
        seqs = rec.seq
        seq = seqs.get(ent[0], 0) + 1
        seqs[ent[0]] = seq
        extra = ""
        if reducing and rec.ddp_refs:  # the manual all-reduce of DDP gradients check
            hit = _field(_ddp_overlap, rec, [get(p, args, kwargs) for p in primary])
            if hit:
                extra = f',"ddp_overlap":{json.dumps(hit)}'
        if lsite is not None and len(lib) < 4096:
            try:
                h = fastpath.make_hit(rec, ent, lsite, frame.f_code)
                if h is not None:
                    lib[(fkey, lsite)] = h
            except Exception as exc:  # noqa: BLE001 - never let bookkeeping break the call
                rec.internal_error(exc)
        elif fkey is not None and len(fast) < 4096 and (gk is None or not gk[1]):
            try:
                # only where the caller is the user's frame: a library caller's site is that of
                # the user frame further out, which this key does not name (a caller in a
                # library module, FSDP's, is told by its globals: no second site lookup)
                site = rec.sites.at(frame)
                if rec.sites._lib.get(fkey[0]) == 0:
                    h = fastpath.make_hit(rec, ent, site, frame.f_code)
                    if h is not None:
                        fast[fkey] = h
            except Exception as exc:  # noqa: BLE001 - never let bookkeeping break the call
                rec.internal_error(exc)
        return _record(rec, ent, seq, orig, args, kwargs, frame, tid, extra)

    wrapper = functools.wraps(orig)(fastpath.make_wrapper(
        orig, fastkey, general, reducing, (_dyn, _tc), (_failed, _track_async), lib))
    setattr(wrapper, _PATCHED_MARK, True)
    return wrapper


def _ddp_overlap(rec, values) -> list[str]:
    from . import ddp as patch_ddp

    return patch_ddp.overlap(rec, values)


def _make_p2p(op: str, orig, spec):
    targ, peers, direction = spec
    params, defaults = _signature(orig)
    get = _arg_getter(params, defaults)
    is_async_op = op in ("isend", "irecv")

    @functools.wraps(orig)
    def wrapper(*args, **kwargs):
        rec = recorder_mod._recorder
        if rec is None or not rec.enabled or rec.local.depth or _compiling():
            return orig(*args, **kwargs)
        tid = _get_ident()
        if tid in rec.inflight:  # send -> isend: only the outermost call is an event
            return orig(*args, **kwargs)
        ent = seq = None
        try:
            group = get("group", args, kwargs)
            gname = rec.group_name(group)
            pre, seq, post, wtag = _p2p_head(rec, op, direction, gname, group, get(targ, args, kwargs),
                                             get(peers[0], args, kwargs), get(peers[1], args, kwargs))
            ent = (gname, pre, post, ',"async":1' if is_async_op else "", op, False, is_async_op, wtag, None)
        except Exception as exc:  # noqa: BLE001 - never let bookkeeping break the call
            rec.internal_error(exc)
        if ent is None:
            return orig(*args, **kwargs)
        return _record(rec, ent, seq, orig, args, kwargs, _getframe(1), tid)

    setattr(wrapper, _PATCHED_MARK, True)
    return wrapper


def _p2p_head(rec, op, direction, gname, group, payload, peer, group_peer) -> tuple[str, int, str, str]:
    """(record text up to the message number, the number, the text after it, the fields that
    name the message: channel and number). A peer or payload that cannot be described is
    recorded as "?" / without its size: torch reports the bad argument."""
    me = rec.rank if rec.rank is not None else -1
    if peer is None and group_peer is not None:
        try:
            from torch.distributed import distributed_c10d as c10d

            peer = c10d.get_global_rank(group, group_peer) if group is not None else group_peer
        except Exception:
            peer = None
    peer_i = _field(lambda x: None if x is None else int(x), peer)
    peer_s = "?" if peer_i is None else str(peer_i)
    channel = f"{me}>{peer_s}" if direction == "send" else f"{peer_s}>{me}"
    seq = rec.next_p2p(f"{gname}:{channel}")
    if op.endswith("object_list"):
        k = _field(lambda x: len(x) if x is not None else 0, payload)
        body = f'"nobj":{k}' if k is not None else '"nobj":0'
    else:
        xs, n = _field(describe.tensors_desc, payload) or ([], 0)
        body = f'"x":[{",".join(xs)}],"n":{n}'
    pre = f'{{"t":"p","op":"{op}","g":"{gname}","ch":"{channel}","s":'
    return pre, seq, "," + body, f'"ch":"{channel}","s":{seq}'


def _make_batch(orig):
    rec_get = recorder_mod.get

    @functools.wraps(orig)
    def wrapper(p2p_op_list, *args, **kwargs):
        rec = rec_get()
        if rec is None or not rec.enabled or getattr(rec.local, "depth", 0) or _compiling():
            return orig(p2p_op_list, *args, **kwargs)
        if _get_ident() in rec.inflight:  # send_object_list(use_batch=True): the outer call is the event
            return orig(p2p_op_list, *args, **kwargs)
        site, tags = -1, []
        try:
            site = rec.sites.current(2)
            ts = rec.now_us()
            for p in p2p_op_list:
                fname = getattr(getattr(p, "op", None), "__name__", "?")
                direction = "send" if "send" in fname else "recv"
                group = getattr(p, "group", None)
                gname = rec.group_name(group)
                pre, seq, post, tag = _p2p_head(rec, fname, direction, gname, group, p.tensor, p.peer,
                                                getattr(p, "group_peer", None))
                tags.append((fname, gname, tag))
                rec.emit_line(f'{pre}{seq}{post},"ts":{ts},"d":0,"site":{site},"batch":1}}')
        except Exception as exc:
            rec.internal_error(exc)
        rec.local.depth = 1
        try:
            result = orig(p2p_op_list, *args, **kwargs)
        finally:
            rec.local.depth = 0
        # One work per op (gloo): each one's wait() is that message's `w` record. A single
        # coalesced work (NCCL) cannot be told apart per message and is not tracked.
        if isinstance(result, list) and len(result) == len(tags):
            for work, (fname, gname, tag) in zip(result, tags):
                _track_async(rec, work, fname, gname, 0, site, tag)
        return result

    setattr(wrapper, _PATCHED_MARK, True)
    return wrapper


#: [Work class, its own wait, ddpdoctor's wait, installed?] (see _patch_work_wait)
_WAIT: list = [None, None, None, False]


def _wait_installed(on: bool) -> None:
    try:
        _WAIT[0].wait = _WAIT[2] if on else _WAIT[1]
        _WAIT[3] = on
    except (TypeError, AttributeError):
        pass


def _patch_work_wait() -> None:
    """``async_op=True`` work completes when its ``wait()`` returns: record that moment.

    Installed on ``Work`` only while some tracked async work is pending (``_track_async``
    installs it, the wait that empties ``rec.async_pending`` removes it): torch's own
    synchronous collectives call ``work.wait()`` too, and a Python wrapper there cost every
    collective ~2k instructions (callgrind) for nothing."""
    import torch

    Work = torch._C._distributed_c10d.Work
    orig = Work.wait
    if getattr(orig, _PATCHED_MARK, False) or _WAIT[0] is not None:
        return

    @functools.wraps(orig)
    def wait(self, *args, **kwargs):
        rec = recorder_mod._recorder
        if rec is None or not rec.async_pending:
            return orig(self, *args, **kwargs)
        info = rec.async_pending.pop(_identity(self), None)
        if not rec.async_pending:
            _wait_installed(False)
        if info is None or (len(info) > 5 and info[5]() is not self):
            return orig(self, *args, **kwargs)
        op, gname, seq, site = info[:4]
        tag = info[4] if len(info) > 4 and info[4] else f'"s":{seq}'
        tid = threading.get_ident()
        if tid in rec.inflight:  # inside another recorded call: that call is the event, and its
            return orig(self, *args, **kwargs)  # in-flight entry must stay until it returns
        start = rec.now_us()
        rec.inflight[tid] = (op + ".wait", gname, seq, site, start)
        try:
            return orig(self, *args, **kwargs)
        finally:
            rec.inflight.pop(tid, None)
            rec.emit_line(f'{{"t":"w","op":"{op}","g":"{gname}",{tag},"ts":{start},'
                          f'"d":{rec.now_us() - start},"site":{site}}}')

    setattr(wait, _PATCHED_MARK, True)
    _WAIT[:] = [Work, orig, wait, False]


def _set(name: str, wrapper) -> None:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    setattr(c10d, name, wrapper)
    if getattr(dist, name, None) is not None:
        setattr(dist, name, wrapper)


_patch_lock = threading.Lock()
_patched = False


def patch() -> bool:
    """Patch ``torch.distributed`` once; returns False where it is not available."""
    global _patched
    with _patch_lock:
        if _patched:
            return True
        import torch.distributed as dist

        if not dist.is_available():
            return False
        from torch.distributed import distributed_c10d as c10d

        from . import groups as lifecycle

        for op, spec in COLLECTIVES.items():
            orig = getattr(c10d, op, None)
            if orig is not None and not getattr(orig, _PATCHED_MARK, False):
                _set(op, _make_collective(op, orig, spec))
        for op, spec in P2P.items():
            orig = getattr(c10d, op, None)
            if orig is not None and not getattr(orig, _PATCHED_MARK, False):
                _set(op, _make_p2p(op, orig, spec))
        orig = getattr(c10d, "batch_isend_irecv", None)
        if orig is not None and not getattr(orig, _PATCHED_MARK, False):
            _set("batch_isend_irecv", _make_batch(orig))
        lifecycle.patch(_set, _PATCHED_MARK)
        _patch_work_wait()
        _patched = True
        return True
