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
import os
import threading
import time
import weakref

from ...trace import ops
from .. import describe
from .. import recorder as recorder_mod
from . import WRAPPED

_PATCHED_MARK = WRAPPED
_get_ident = threading.get_ident
_perf_ns = time.perf_counter_ns
_write = os.write


try:  # whether torch.compile is tracing: a Python side effect there would break its graph
    from torch.compiler import is_compiling as _compiling
except ImportError:  # torch older than 2.3
    def _compiling() -> bool:
        return False
_ASYNC = ',"async":1'
#: Issue synchronous all_reduce calls asynchronously and record while they run (see
#: _Call.run_overlapped); DDPDOCTOR_OVERLAP=0 turns it off.
OVERLAP = os.environ.get("DDPDOCTOR_OVERLAP", "1") != "0"

# op -> (primary tensor params, other tensor params, root params, object params), from the op table.
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


class _Call:
    """Bookkeeping shared by all wrappers: depth guard, in-flight slot, event line."""

    __slots__ = ()

    @staticmethod
    def failed(rec, exc: BaseException, begin: str, site, start: int, key: tuple) -> None:
        """Record a call that raised (the exception itself propagates unchanged)."""
        rec.last_failed = key  # a hang that ends in an error is no "resolved"
        err = json.dumps(f"{type(exc).__name__}: {exc}"[:500])
        rec.emit_line(f'{begin},"d":{(_perf_ns() - start) // 1000},"site":{site},"err":{err}}}')

    @staticmethod
    def done(rec, begin: str, site, start: int, start_us: int, op: str, gname: str, seq: int,
             tail: str = "") -> None:
        """Record a call that returned: one line, one ``os.write`` (inlined: the hot path)."""
        dur = (_perf_ns() - start) // 1000
        line = f'{begin},"d":{dur},"site":{site}{tail}}}\n'
        w = rec.writer
        if w is not None and not w.closed:
            try:
                _write(w.fd, line.encode("utf-8", "backslashreplace"))
            except OSError as exc:
                rec.internal_error(exc)
        else:
            rec.emit_line(line[:-1])
        rec.events += 1
        rec.last_event = (op, gname, seq, site, start_us + dur)

    @staticmethod
    def begin(rec, kind: str, head: str, op: str, gname: str, seq: int, site, start_us: int) -> str:
        """Mark the call in flight (watchdog, in-flight file); returns the record's first half."""
        # InFlight's fields as a plain tuple: a named tuple costs 0.4 µs more on every call.
        rec.inflight[_get_ident()] = (op, gname, seq, site, start_us)
        begin = f'{{"t":"{kind}",{head},"ts":{start_us}'
        slot = rec.slot
        if slot is not None:  # survives the process dying inside the call (see inflightfile)
            slot.set(f'{begin},"site":{site}}}')
        return begin

    @staticmethod
    def run_overlapped(rec, local, orig, args, kwargs, head: str, gname: str, seq: int, op: str,
                       apos: int):
        """A synchronous call issued as ``async_op=True`` and waited for here: the same work,
        result (None) and exceptions, but the call site and the record are made while the
        collective is already on its way, off its critical path. torch's own synchronous path
        is exactly ``work = ...; work.wait()``."""
        start = _perf_ns()
        start_us = (start - rec.t0_ns) // 1000
        key = (op, gname, seq, start_us)
        slot = rec.slot
        if slot is not None:  # before the call: gloo can abort the process right after issue
            slot.set(f'{{"t":"c",{head},"ts":{start_us},"site":-1}}')
        local.depth = 1
        try:
            work = _issue_async(orig, args, kwargs, apos)
        except BaseException as exc:  # refused before anything was sent (bad arguments...)
            local.depth = 0
            _Call.failed(rec, exc, f'{{"t":"c",{head},"ts":{start_us}', rec.sites.current(3), start, key)
            raise
        site = rec.sites.current(3)
        begin = _Call.begin(rec, "c", head, op, gname, seq, site, start_us)
        try:
            if work is not None:
                work.wait()
        except BaseException as exc:
            local.depth = 0
            rec.inflight.pop(_get_ident(), None)
            _Call.failed(rec, exc, begin, site, start, key)
            raise
        local.depth = 0
        del rec.inflight[_get_ident()]
        _Call.done(rec, begin, site, start, start_us, op, gname, seq)
        return None

    @staticmethod
    def run(rec, local, orig, args, kwargs, head: str, gname: str, seq: int, op: str,
            is_async: bool, kind: str = "c", wtag: str = ""):
        site = rec.sites.current(3)
        start = _perf_ns()
        start_us = (start - rec.t0_ns) // 1000
        begin = _Call.begin(rec, kind, head, op, gname, seq, site, start_us)
        local.depth = 1
        try:
            result = orig(*args, **kwargs)
        except BaseException as exc:
            local.depth = 0
            rec.inflight.pop(_get_ident(), None)
            _Call.failed(rec, exc, begin, site, start, (op, gname, seq, start_us))
            raise
        local.depth = 0
        del rec.inflight[_get_ident()]
        _Call.done(rec, begin, site, start, start_us, op, gname, seq, _ASYNC if is_async else "")
        if is_async and result is not None:
            _track_async(rec, result, op, gname, seq, site, wtag)
        return result


def _issue_async(orig, args, kwargs, apos: int):
    if apos < len(args):
        a = list(args)
        a[apos] = True
        return orig(*a, **kwargs)
    return orig(*args, **dict(kwargs, async_op=True))


def _track_async(rec, result, op, gname, seq, site, wtag: str = "") -> None:
    """Remember issued async work until its ``wait()``. ``wtag`` (p2p only) is the JSON fields
    that name the message in the ``w`` record (``"ch":..,"s":..``); p2p keep seq 0 here, as
    they are in no group's sequence."""
    works = result if isinstance(result, list) else [result]
    pending = rec.async_pending
    for w in works:
        key = id(w)

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


def _make_collective(op: str, orig, spec):
    primary, other, roots, objs = spec
    op = _CANONICAL.get(op, op)
    params, defaults = _signature(orig)
    get = _arg_getter(params, defaults)
    has_group = "group" in params or "group" in defaults
    has_async = "async_op" in params
    has_op = op in _REDUCING and op != "broadcast"
    rec_get = recorder_mod.get
    from torch.distributed import distributed_c10d as c10d

    non_member = c10d.GroupMember.NON_GROUP_MEMBER
    # The hot path reads its arguments by position, without a call per argument.
    gpos = params.index("group") if "group" in params else len(params) + 99
    gdef = defaults.get("group")
    one = primary[0] if len(primary) == 1 else None
    xpos = params.index(one) if one in params else len(params) + 99
    opos = params.index("op") if "op" in params else len(params) + 99
    odef = defaults.get("op")
    apos = params.index("async_op") if "async_op" in params else len(params) + 99
    simple = one is not None and not roots and not other and not objs and has_async
    fast: dict = {}

    @functools.wraps(orig)
    def wrapper(*args, **kwargs):
        rec = rec_get()
        if rec is None or not rec.enabled or _compiling():  # torch.compile traces: step aside
            return orig(*args, **kwargs)
        local = rec.local
        if getattr(local, "depth", 0):
            return orig(*args, **kwargs)
        issued = False
        try:
            nargs = len(args)
            group = (args[gpos] if gpos < nargs else kwargs.get("group", gdef)) if has_group else None
            if group is non_member:
                return orig(*args, **kwargs)
            if simple:
                # The common call (one tensor, maybe a reduce op): everything but the sequence
                # number is cached per (group, shape, dtype, device, op).
                v = args[xpos] if xpos < nargs else kwargs.get(one, defaults.get(one))
                rop = (args[opos] if opos < nargs else kwargs.get("op", odef)) if has_op else None
                try:
                    key = (group, v.shape, v.dtype, v.device, rop)
                    ent = fast.get(key)
                except (AttributeError, TypeError):  # not a tensor, an unhashable reduce op
                    key = ent = None
                if ent is None and key is not None and len(fast) < 4096:
                    gname = "0" if group is None else rec.group_name(group)
                    d, n = describe.tensor_desc(v)
                    tail = f',"x":[{d}],"n":{n}'
                    if has_op:
                        tail += f',"rop":"{describe.redop_name(rop)}"'
                    ent = fast[key] = (gname, f'"op":"{op}","g":"{gname}","s":', tail)
                if ent is not None:
                    gname = ent[0]
                    seq = rec.next_seq(gname)
                    head = f"{ent[1]}{seq}{ent[2]}"
                    if rec.ddp_refs and op in _REDUCING:
                        from . import ddp as patch_ddp

                        hit = patch_ddp.overlap(rec, [v])
                        if hit:
                            head += f',"ddp_overlap":{json.dumps(hit)}'
                    is_async = bool(args[apos] if apos < nargs else kwargs.get("async_op", False))
                    # From here the collective is issued: its own exception is the program's,
                    # never retried below as a bookkeeping failure (that ran it twice).
                    issued = True
                    if not is_async and OVERLAP:
                        return _Call.run_overlapped(rec, local, orig, args, kwargs, head, gname, seq, op,
                                                    apos)
                    return _Call.run(rec, local, orig, args, kwargs, head, gname, seq, op, is_async)
            gname = "0" if group is None else rec.group_name(group)
            seq = rec.next_seq(gname)
            parts = [f'"op":"{op}","g":"{gname}","s":{seq}']
            if one is not None:
                v = args[xpos] if xpos < nargs else kwargs.get(one, defaults.get(one))
                if v is None or isinstance(v, (list, tuple)):
                    xs, n = describe.tensors_desc(v)
                    parts.append(f'"x":[{",".join(xs)}],"n":{n}')
                else:
                    d, n = describe.tensor_desc(v)
                    parts.append(f'"x":[{d}],"n":{n}')
            elif primary:
                xs: list[str] = []
                n = 0
                for p in primary:
                    d, k = describe.tensors_desc(get(p, args, kwargs))
                    xs.extend(d)
                    n += k
                parts.append(f'"x":[{",".join(xs)}],"n":{n}')
            if has_op:
                parts.append(f'"rop":"{describe.redop_name(args[opos] if opos < nargs else kwargs.get("op", odef))}"')
            for r in roots:
                v = get(r, args, kwargs)
                if v is not None:
                    parts.append(f'"{"root" if r in ("src", "dst") else "groot"}":{int(v)}')
            if other:
                xo: list[str] = []
                for p in other:
                    xo.extend(describe.tensors_desc(get(p, args, kwargs))[0])
                parts.append(f'"xo":[{",".join(xo)}]')
            for p in objs:
                v = get(p, args, kwargs)
                if p == "object_list" or p == "scatter_object_output_list":
                    parts.append(f'"nobj":{len(v) if v is not None else 0}')
                else:
                    parts.append(f'"obj":{describe.object_desc((v,))}')
            if rec.ddp_refs and primary and op in _REDUCING:
                from . import ddp as patch_ddp

                hit = patch_ddp.overlap(rec, [get(p, args, kwargs) for p in primary])
                if hit:
                    parts.append(f'"ddp_overlap":{json.dumps(hit)}')
            is_async = bool(get("async_op", args, kwargs)) if has_async else False
            head = ",".join(parts)
        except Exception as exc:  # never let bookkeeping break the call
            if issued:
                raise
            rec.internal_error(exc)
            return orig(*args, **kwargs)
        return _Call.run(rec, local, orig, args, kwargs, head, gname, seq, op, is_async)

    setattr(wrapper, _PATCHED_MARK, True)
    return wrapper


def _make_p2p(op: str, orig, spec):
    targ, peers, direction = spec
    params, defaults = _signature(orig)
    get = _arg_getter(params, defaults)
    rec_get = recorder_mod.get
    is_async_op = op in ("isend", "irecv")

    @functools.wraps(orig)
    def wrapper(*args, **kwargs):
        rec = rec_get()
        if rec is None or not rec.enabled or _compiling():  # torch.compile traces: step aside
            return orig(*args, **kwargs)
        local = rec.local
        if getattr(local, "depth", 0):
            return orig(*args, **kwargs)
        try:
            group = get("group", args, kwargs)
            gname = rec.group_name(group)
            head, wtag = _p2p_head(rec, op, direction, gname, group, get(targ, args, kwargs),
                                   get(peers[0], args, kwargs), get(peers[1], args, kwargs))
        except Exception as exc:
            rec.internal_error(exc)
            return orig(*args, **kwargs)
        return _Call.run(rec, local, orig, args, kwargs, head, gname, 0, op, is_async_op, kind="p",
                         wtag=wtag)

    setattr(wrapper, _PATCHED_MARK, True)
    return wrapper


def _p2p_head(rec, op, direction, gname, group, payload, peer, group_peer) -> tuple[str, str]:
    """(event fields, the fields that name the message: channel and its number)."""
    me = rec.rank if rec.rank is not None else -1
    if peer is None and group_peer is not None:
        try:
            from torch.distributed import distributed_c10d as c10d

            peer = c10d.get_global_rank(group, group_peer) if group is not None else group_peer
        except Exception:
            peer = None
    peer_s = "?" if peer is None else str(int(peer))
    channel = f"{me}>{peer_s}" if direction == "send" else f"{peer_s}>{me}"
    seq = rec.next_p2p(f"{gname}:{channel}")
    if op.endswith("object_list"):
        body = f'"nobj":{len(payload) if payload is not None else 0}'
    else:
        xs, n = describe.tensors_desc(payload)
        body = f'"x":[{",".join(xs)}],"n":{n}'
    tag = f'"ch":"{channel}","s":{seq}'
    return f'"op":"{op}","g":"{gname}",{tag},{body}', tag


def _make_batch(orig):
    rec_get = recorder_mod.get

    @functools.wraps(orig)
    def wrapper(p2p_op_list, *args, **kwargs):
        rec = rec_get()
        if rec is None or not rec.enabled or getattr(rec.local, "depth", 0) or _compiling():
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
                head, tag = _p2p_head(rec, fname, direction, gname, group, p.tensor, p.peer,
                                      getattr(p, "group_peer", None))
                tags.append((fname, gname, tag))
                rec.emit_line(f'{{"t":"p",{head},"ts":{ts},"d":0,"site":{site},"batch":1}}')
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


def _patch_work_wait() -> None:
    """``async_op=True`` work completes when its ``wait()`` returns: record that moment."""
    import torch

    Work = torch._C._distributed_c10d.Work
    orig = Work.wait
    if getattr(orig, _PATCHED_MARK, False):
        return
    rec_get = recorder_mod.get

    @functools.wraps(orig)
    def wait(self, *args, **kwargs):
        rec = rec_get()
        if rec is None or not rec.async_pending:
            return orig(self, *args, **kwargs)
        info = rec.async_pending.pop(id(self), None)
        if info is None or (len(info) > 5 and info[5]() is not self):
            return orig(self, *args, **kwargs)
        op, gname, seq, site = info[:4]
        tag = info[4] if len(info) > 4 and info[4] else f'"s":{seq}'
        tid = threading.get_ident()
        start = rec.now_us()
        rec.inflight[tid] = (op + ".wait", gname, seq, site, start)
        try:
            return orig(self, *args, **kwargs)
        finally:
            rec.inflight.pop(tid, None)
            rec.emit_line(f'{{"t":"w","op":"{op}","g":"{gname}",{tag},"ts":{start},'
                          f'"d":{rec.now_us() - start},"site":{site}}}')

    setattr(wait, _PATCHED_MARK, True)
    try:
        Work.wait = wait
    except (TypeError, AttributeError):
        pass


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
