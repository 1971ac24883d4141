"""DistributedDataParallel's own communication, made visible.

DDP broadcasts parameters at construction, may broadcast buffers (or rebuild buckets) in
forward, and all-reduces gradients in backward, all from C++: a patch of ``dist.all_reduce``
sees none of it. Rather than a global dispatch mode (1.17x on a DDP step here) we wrap
``DistributedDataParallel.__init__`` and ``forward`` and hang one autograd hook on the output:
a few µs a step. Each of these points that communicates is an event in the DDP group's sequence
(``ddp_init``, ``ddp_forward``, ``ddp_backward``), so "rank 0 ran the model alone" and "rank 1
ran one step more" show up as divergence. A forward that does not communicate (no buffers to
sync, no grad) is recorded as a plain event and takes no sequence number: running the model on
one rank under ``no_grad`` is legitimate when it has no buffers.
"""

from __future__ import annotations

import functools
import json
import sys
import threading
import time
import weakref
import zlib
from collections import OrderedDict as _OrderedDict

from ...trace.records import InFlight
from .. import callsite, native
from .. import recorder as recorder_mod
from ..callsite import resume_frames
from . import WRAPPED, compiled

_MARK = WRAPPED
#: Identity without id(), which raises an audit event (a call into every audit hook) per use.
_identity = object.__hash__
_perf_ns = time.perf_counter_ns


def fingerprint(params) -> str:
    """Cheap digest of parameter values: a few elements of each (one device sync, once)."""
    import torch

    try:
        with torch.no_grad():
            vals = [p.detach().reshape(-1)[:16].double().sum() for p in params]
            if not vals:
                return "empty"
            data = torch.stack(vals).cpu().tolist()
        return format(zlib.crc32(repr([round(v, 6) for v in data]).encode()), "08x")
    except Exception:
        return "?"


def _names_digest(named) -> str:
    s = ";".join(f"{n}:{tuple(p.shape)}" for n, p in named)
    return format(zlib.crc32(s.encode()), "08x")


def _extent(t) -> tuple[int, int]:
    """Byte range [lo, hi) a tensor's elements span inside its storage."""
    n = t.numel()
    if n == 0:
        return 0, 0
    span = 1 + sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))
    lo = t.data_ptr()
    return lo, lo + span * t.element_size()


def overlap(rec, values) -> list[str]:
    """Names of DDP parameters/gradients whose memory a collective's tensors overlap.

    Matched by byte range inside the storage, not by storage alone: with
    ``gradient_as_bucket_view=True`` all gradients of a bucket share one storage. A hit is
    confirmed against the live tensor, since freed gradient memory is soon reused by unrelated
    tensors (a logged loss) while the map may still name it."""
    import weakref

    inflight = getattr(rec, "inflight", {})
    if any(isinstance(k, tuple) and k[0] == "ddp_bwd" for k in list(inflight)):
        return []  # inside DDP's backward: DDP's own reduction (a comm hook), not a manual one
    state = rec.__dict__.setdefault("_ddp_ptrs", {"dirty": True, "map": {}})
    if state["dirty"]:
        ptrs: dict[int, list] = {}
        for ref in rec.ddp_refs:
            mod = ref()
            if mod is None:
                continue
            info = getattr(mod, "_ddpdoctor", None) or {}
            # DDP reduced the current gradients only if its last reducing backward came from
            # the last grad-enabled forward; a forward since (under no_sync, or with
            # require_backward_grad_sync off) means they are local: a manual all-reduce of them
            # is the job's only reduction (custom gradient sync), not a second one
            reduced = info.get("gfwd", 0) <= info.get("fwd_at_bwd", 0)
            for name, p in mod.module.named_parameters():
                for t, label, is_grad in ((p, name, False), (p.grad, name + ".grad", True)):
                    if t is None or (is_grad and not reduced):
                        continue
                    try:
                        lo, hi = _extent(t)
                        sp = t.untyped_storage().data_ptr()
                    except Exception:
                        continue
                    if sp and hi > lo:
                        ptrs.setdefault(sp, []).append((lo, hi, label, weakref.ref(p), is_grad))
        state["map"], state["dirty"] = ptrs, False
    found: list[str] = []
    ptrs = state["map"]
    for v in values:
        for t in (v if isinstance(v, (list, tuple)) else [v]):
            try:
                sp = t.untyped_storage().data_ptr()
                cands = ptrs.get(sp)
                if not cands:
                    continue
                lo, hi = _extent(t)
            except Exception:
                continue
            for clo, chi, name, pref, is_grad in cands:
                if clo >= hi or lo >= chi or name in found:
                    continue
                p = pref()
                cur = None if p is None else (p.grad if is_grad else p)
                try:
                    if cur is None or cur.untyped_storage().data_ptr() != sp:
                        continue
                except Exception:
                    continue
                found.append(name)
                if len(found) >= 8:
                    return found
    return found


def _first_grad_tensor(out, depth: int = 0):
    import torch

    if isinstance(out, torch.Tensor):
        return out if out.requires_grad else None
    if depth > 2:
        return None
    items = out.values() if isinstance(out, dict) else out if isinstance(out, (list, tuple)) else ()
    for v in items:
        t = _first_grad_tensor(v, depth + 1)
        if t is not None:
            return t
    return None


def patch() -> None:
    import torch
    from torch.nn.parallel import distributed as ddp_mod

    DDP = ddp_mod.DistributedDataParallel
    if getattr(DDP.__init__, _MARK, False):
        return
    global _queue_callback, _attach, _forward_end, _forward_begin
    _queue_callback = torch.autograd.Variable._execution_engine.queue_callback
    mod = _native(torch)
    _attach = getattr(mod, "attach", _attach_python)
    _forward_end = getattr(mod, "forward_end", _forward_end_python)
    _forward_begin = getattr(mod, "forward_begin", _forward_begin_python)
    _TENSOR[0] = torch.Tensor
    _MODULE_GLOBALS[0] = vars(sys.modules["torch.nn.modules.module"])
    _FWD[:] = _fwd_defaults(torch)
    orig_init = DDP.__init__
    orig_forward = DDP.forward
    rec_get = recorder_mod.get

    @functools.wraps(orig_init)
    def __init__(self, module, *args, **kwargs):
        rec = rec_get()
        if rec is None or not rec.enabled or getattr(rec.local, "depth", 0):
            return orig_init(self, module, *args, **kwargs)
        try:
            site = rec.sites.current(2)
            named = list(module.named_parameters())
            pg = kwargs.get("process_group", args[5] if len(args) > 5 else None)
            gname = rec.group_name(pg)
            fp = fingerprint([p for _, p in named])
            seq = rec.next_seq(gname)
            start = rec.now_us()
        except Exception as exc:
            rec.internal_error(exc)
            seq = None
        if seq is None:  # issued outside the handler: nothing of ours chained to its errors
            return orig_init(self, module, *args, **kwargs)
        key = ("ddp_init", id(self))
        rec.inflight[key] = InFlight("ddp_init", gname, seq, site, start)
        rec.local.depth = 1
        try:
            orig_init(self, module, *args, **kwargs)
        except BaseException as exc:
            rec.local.depth = 0
            rec.inflight.pop(key, None)
            rec.emit_line(f'{{"t":"c","op":"ddp_init","g":"{gname}","s":{seq},"ts":{start},'
                          f'"d":{rec.now_us() - start},"site":{site},'
                          f'"err":{json.dumps(f"{type(exc).__name__}: {exc}"[:500])}}}')
            raise
        rec.local.depth = 0
        rec.inflight.pop(key, None)
        try:
            rec.emit_line(f'{{"t":"c","op":"ddp_init","g":"{gname}","s":{seq},"ts":{start},'
                          f'"d":{rec.now_us() - start},"site":{site},"np":{len(named)}}}')
            bufs = sum(1 for _ in module.buffers())
            rec.emit({"t": "ddp", "g": gname, "s": seq, "site": site, "nparams": len(named),
                      "names": _names_digest(named), "init_fp": fp, "nbuffers": bufs,
                      "broadcast_buffers": bool(getattr(self, "broadcast_buffers", True)),
                      "find_unused": bool(getattr(self, "find_unused_parameters", False)),
                      "params": [[n, list(p.shape)] for n, p in named[:40]]})
            rec.ddp_refs.append(weakref.ref(self))
            rec.__dict__.setdefault("_ddp_ptrs", {"dirty": True, "map": {}})["dirty"] = True
            self._ddpdoctor = {"g": gname, "site": site, "bwd": 0, "fwd": 0, "grads": None,
                               "fkey": ("ddp_fwd", _identity(self))}
        except Exception as exc:
            rec.internal_error(exc)
        from . import replicas  # digests of the replica (replica-drift); off the step path

        replicas.on_ddp_init(rec, self)
        from . import grads  # non-finite and per-rank gradients (DD015, DD016)

        grads.on_ddp_init(rec, self, getattr(self, "_ddpdoctor", {}))

    @functools.wraps(orig_forward)
    def forward(self, *inputs, **kwargs):
        rec = recorder_mod._recorder
        info = getattr(self, "_ddpdoctor", None)
        if rec is None or not rec.enabled or info is None or rec.local.depth:
            return orig_forward(self, *inputs, **kwargs)
        try:
            comm, seq, start, site, sync_bufs, grad, rebuilt_before, gname, fkey = _forward_begin(self, rec, info)
        except Exception as exc:
            rec.internal_error(exc)
            fkey = None
        if fkey is None:  # issued outside the handler: nothing of ours chained to its errors
            return orig_forward(self, *inputs, **kwargs)
        rec.local.depth = 1
        try:
            out = orig_forward(self, *inputs, **kwargs)
        except BaseException as exc:
            rec.local.depth = 0
            rec.inflight.pop(fkey, None)
            err = json.dumps(f"{type(exc).__name__}: {exc}"[:500])
            kind = "c" if comm else "e"
            rec.emit_line(f'{{"t":"{kind}","op":"ddp_forward","g":"{gname}","s":{seq},"ts":{start},'
                          f'"d":{rec.now_us() - start},"site":{site},"err":{err}}}')
            raise
        rec.local.depth = 0
        rec.inflight.pop(fkey, None)
        _forward_end(self, rec, info, out, comm, seq, start, site, sync_bufs, grad, rebuilt_before)
        return out

    setattr(__init__, _MARK, True)
    setattr(forward, _MARK, True)
    DDP.__init__ = __init__
    DDP.forward = forward
    compiled.before_compile(lambda: compiled.run_eagerly(DDP, "forward"))
    compiled.before_compile(_helpers_eager)
    _patch_join()


def _forward_site(sites, f) -> int:
    """``sites.at(f)`` for a DDP forward called as ``model(x)``: ``f`` is nn.Module's
    ``_call_impl``, under ``_wrapped_call_impl``, under the user's line. The same key and the
    same table as ``SiteTable.at`` (so the same site id), found without its general walk: the
    two frames of nn.Module are passed by the identity of their globals, and the user's frame
    must be one ``at`` has already classified as the user's, with the key already interned
    (~70 bytecodes less per step, issue #11). Anything else takes ``at`` itself. Where ``at``
    builds its key in C (callsite._site_key) it is cheaper than this walk and is used alone."""
    if callsite._site_key is not None:
        return sites.at(f)
    g = f.f_globals
    if g is _MODULE_GLOBALS[0]:
        u = f.f_back
        if u is not None and u.f_globals is g:
            u = u.f_back
        if u is not None:
            # (nn.Module's own globals are plain library code, kind 1, for ``at`` too: torch is
            # a skip prefix from activation on)
            uk = sites._gkind.get(_identity(u.f_globals))
            if uk is not None and not uk[1]:
                cid = _identity(u.f_code)
                if sites._lib.get(cid) == 0:
                    b = u.f_back
                    sid = sites._at.get((cid, u.f_lasti, -1 if b is None else b.f_lasti))
                    if sid is not None:
                        return sid
    return sites.at(f)


_MODULE_GLOBALS: list = [None]

#: The forward record's optional fields, by ``sync_bufs + 2 * grad``.
_EXTRA = ("", ',"bufs":1', ',"grad":1', ',"bufs":1,"grad":1')


def _hook_output(t, hook) -> None:
    """``t.register_hook(hook)`` without the handle, which is never used: the same dict of hooks
    on the tensor and the same registration with its autograd node, minus a Python method, an
    import statement and a ``RemovableHandle`` per step (~60 bytecodes, issue #11). A tensor
    that already has hooks, no node or a ``__torch_function__`` type takes the public call."""
    if type(t) is _TENSOR[0] and t._backward_hooks is None:
        fn = t.grad_fn
        if fn is not None:
            hooks = _OrderedDict()
            hooks[_HOOK_ID] = hook
            t._backward_hooks = hooks
            fn._register_hook_dict(t)
            return
    t.register_hook(hook)


#: Our key in the output's hook dict: ``RemovableHandle`` numbers its hooks from 0 upwards.
_HOOK_ID = -1
_TENSOR: list = [None]


def _store(rec, line: str) -> None:
    """One whole record (with its newline) into the mapped trace file: what ``emit_line`` does,
    without its checks and string copies on the step path (~50 bytecodes, counted)."""
    data = line.encode("utf-8", "backslashreplace")
    try:
        rec.writer.mm.write(data)  # a memcpy, no syscall (trace/mappedtrace.py)
    except (AttributeError, ValueError):  # a full chunk, a plain writer, no file (yet)
        rec.emit_bytes(data)


class _BackwardHook:
    """Marks the start of DDP's gradient all-reduce (backward reaches the output) and, through an
    autograd-engine callback, its end. The callbacks are this object's bound methods: nothing
    else is made per step (a closure and a lambda per backward before). ``key`` is None until
    the hook fired (it fires once: a second output of the same forward reaching it later is
    the same backward)."""

    __slots__ = ("rec", "info", "site", "key", "seq", "start", "step")

    def __init__(self, rec, info, site) -> None:
        self.rec, self.info, self.site, self.key = rec, info, site, None

    def __call__(self, grad):
        if self.key is not None:
            return None
        rec = self.rec
        try:
            info = self.info
            self.key = key = ("ddp_bwd", _get_ident())
            self.step = step = info["bwd"] = info["bwd"] + 1
            info["fwd_at_bwd"] = info["fwd"]
            g = info["g"]
            seqs = rec.seq
            self.seq = seq = seqs.get(g, 0) + 1
            seqs[g] = seq
            self.start = start = (_perf_ns() - rec.t0_ns) // 1000
            rec.inflight[key] = ("ddp_backward", g, seq, self.site, start)
            # This hook runs before any parameter's gradient, so a callback queued now would run
            # before the one DDP queues to wait for its all-reduce; queueing again from inside
            # ours puts the end of the event after DDP's wait. (The re-queue is a C partial,
            # not a Python method: one Python frame less per backward, issue #11.)
            _queue_callback(_partial(_queue_callback, self._done))
            grads = info["grads"]
            if grads is not None:  # DD015/DD016 (grads.py): before DDP queues its end-of-backward callback
                grads(grad, step, self.site)
        except Exception as exc:
            rec.internal_error(exc)
        return None

    def _done(self) -> None:
        rec = self.rec
        rec.inflight.pop(self.key, None)
        # gradients exist now (the first backward creates them): rebuild the overlap map
        rec._ddp_ptrs["dirty"] = True
        start = self.start
        _store(rec, f'{{"t":"c","op":"ddp_backward","g":"{self.info["g"]}","s":{self.seq},"ts":{start},'
                    f'"d":{(_perf_ns() - rec.t0_ns) // 1000 - start},"site":{self.site},'
                    f'"step":{self.step}}}\n')


def _native(torch):
    """The backward event in C (rank/_ddpstep.c: ``attach`` = ``_attach_python`` with the hook
    and both engine callbacks one C object, DD015's test of a CPU float gradient without a torch
    reduction; ~40k instructions of Python and torch per step before, issue #11), or None: not
    built, or ``DDPDOCTOR_NATIVE=0``."""
    mod = native.load("_ddpstep")
    if not _FWD:
        _FWD[:] = _fwd_defaults(torch)
    if mod is not None:
        mod.setup(_queue_callback, _perf_ns, torch.Tensor, torch.float32, torch.float64, torch.strided,
                  _OrderedDict, _HOOK_ID, _first_grad_tensor, *_FWD, callsite._site_key)
    return mod


def _forward_begin_python(self, rec, info) -> tuple:
    """Before a DDP forward runs: whether it communicates, its sequence number, start, call site
    and in-flight entry."""
    is_grad_enabled, site_of = _FWD
    grad = is_grad_enabled()
    # DDP's own test, two Python calls: only for a module with buffers to broadcast
    sync_bufs = bool(self.modules_buffers) and bool(self._check_sync_bufs_pre_fwd())
    rebuilt_before = getattr(self, "_has_rebuilt_buckets", True)
    comm = sync_bufs or (grad and not rebuilt_before and info["bwd"] > 0)
    gname = info["g"]
    try:  # the caller's frame (nn.Module's) without sys._getframe (an audit event): see callsite
        site = site_of(rec.sites, resume_frames(None).f_back.f_back)
    except ValueError:  # another thread is inside the frame generator
        site = rec.sites.current(3)
    seq = rec.next_seq(gname) if comm else 0
    start = (_perf_ns() - rec.t0_ns) // 1000
    fkey = info["fkey"]
    rec.inflight[fkey] = ("ddp_forward", gname, seq, site, start)
    return comm, seq, start, site, sync_bufs, grad, rebuilt_before, gname, fkey


#: ``torch.is_grad_enabled`` and the forward's site lookup (``patch`` sets them).
_FWD: list = []


def _fwd_defaults(torch) -> list:
    # with the C site key ``at`` is the short path itself: called directly, one frame less
    return [torch.is_grad_enabled, _forward_site if callsite._site_key is None else callsite.SiteTable.at]


def _forward_end_python(self, rec, info, out, comm, seq, start, site, sync_bufs, grad, rebuilt_before) -> None:
    """After a DDP forward returned: its record, then the hook of its backward on the output."""
    try:
        gname = info["g"]
        info["fwd"] += 1
        if grad:  # the last forward a backward can come from (overlap(): was it reduced?)
            info["gfwd"] = info["fwd"]
        rebuilt = rebuilt_before is False and getattr(self, "_has_rebuilt_buckets", False) is True
        if rebuilt and not comm:  # it did communicate after all
            comm, seq = True, rec.next_seq(gname)
        _store(rec, f'{{"t":"{"c" if comm else "e"}","op":"ddp_forward","g":"{gname}","s":{seq},'
                    f'"ts":{start},"d":{(_perf_ns() - rec.t0_ns) // 1000 - start},"site":{site},'
                    f'"step":{info["fwd"]}{_EXTRA[sync_bufs + 2 * grad]}}}\n')
        rec._ddp_ptrs["dirty"] = True
        if grad and self.require_backward_grad_sync:
            if type(out) is _TENSOR[0]:  # the common case, without a call
                t = out if out.requires_grad else None
            else:
                t = _first_grad_tensor(out)
            if t is not None:
                # (a tensor hook, not a pre-hook of its node, which would be ~25 bytecodes
                # cheaper: the hook is handed this tensor's own gradient, see grads.py)
                _attach(t, rec, info, site)
    except Exception as exc:
        rec.internal_error(exc)


def _helpers_eager() -> None:
    """Before ``torch.compile``: the forward's Python helpers (no C extension) run eagerly as the
    forward wrapper does (compiled.py); dynamo would trace their bookkeeping (the clock, dicts,
    the trace file) and warn in the user's output. The C ones are no Python frames."""
    global _forward_begin, _forward_end
    import torch._dynamo

    if _forward_begin is _forward_begin_python:
        _forward_begin = torch._dynamo.disable(_forward_begin_python)
    if _forward_end is _forward_end_python:
        _forward_end = torch._dynamo.disable(_forward_end_python)


def _attach_python(t, rec, info, site) -> None:
    """The forward's output ``t`` gets the hook of its backward event."""
    _hook_output(t, _BackwardHook(rec, info, site))


#: ``_attach_python`` and ``_forward_end_python`` or their C twins (``patch`` sets them).
_attach = _attach_python
_forward_end = _forward_end_python
_forward_begin = _forward_begin_python


def _queue_callback(callback) -> None:
    """The autograd engine's ``queue_callback``; ``patch`` rebinds this name to the engine's bound
    method itself (no Python frame per call)."""
    import torch

    torch.autograd.Variable._execution_engine.queue_callback(callback)


_get_ident = threading.get_ident
_partial = functools.partial


def _patch_join() -> None:
    """Join lets ranks with fewer inputs shadow the others' collectives, so inside it per-rank
    sequences legitimately differ: the block is recorded as one opaque region (nothing inside is
    an event), and leaving it, which all ranks do together, is one event in the sequence."""
    try:
        from torch.distributed.algorithms import join as join_mod
    except Exception:
        return
    Join = join_mod.Join
    if getattr(Join.__enter__, _MARK, False):
        return
    orig_enter, orig_exit = Join.__enter__, Join.__exit__
    rec_get = recorder_mod.get

    @functools.wraps(orig_enter)
    def __enter__(self):
        rec = rec_get()
        if rec is not None and rec.enabled:
            rec.emit({"t": "e", "op": "join_enter", "ts": rec.now_us(), "site": rec.sites.current(2)})
            rec.local.depth = getattr(rec.local, "depth", 0) + 1
        return orig_enter(self)

    @functools.wraps(orig_exit)
    def __exit__(self, *exc):
        rec = rec_get()
        if rec is None or not rec.enabled:
            return orig_exit(self, *exc)
        start = rec.now_us()
        site = rec.sites.current(2)
        try:
            return orig_exit(self, *exc)
        finally:
            rec.local.depth = max(0, getattr(rec.local, "depth", 1) - 1)
            if not getattr(rec.local, "depth", 0):
                g = rec.group_name(getattr(self, "_process_group", None))
                rec.emit_line(f'{{"t":"c","op":"join","g":"{g}","s":{rec.next_seq(g)},"ts":{start},'
                              f'"d":{rec.now_us() - start},"site":{site}}}')

    setattr(__enter__, _MARK, True)
    Join.__enter__ = __enter__
    Join.__exit__ = __exit__
