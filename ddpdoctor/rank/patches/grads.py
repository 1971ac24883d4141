"""Non-finite gradients of DDP models, for the nonfinite-gradients check (DD015).

DDP averages every rank's local gradients: one NaN/Inf on one rank reaches every replica. What
each rank can see cheaply, before the average, is the gradient that reaches the model's output
when backward starts (the hook of ``patches/ddp.py`` already runs there): every parameter's local
gradient is computed from it, so a non-finite loss or output shows up in it. Per backward that is
one reduction of that tensor (``sum``, which propagates NaN and Inf) and one ``item()``: O(1)
Python work, whatever the model's size. Only when it is non-finite (the rare path) does this
module look further: whether the parameters were already non-finite (an earlier step applied
non-finite values), and whether an optimizer step then applied the averaged gradients (its
gradients checked at ``step()``), or nothing stepped (the next backward came first), or a
``GradScaler`` skipped the step. On an accelerator the check never waits for the device: the
reduction is copied to pinned memory and read once its event has completed (at a later backward,
optimizer step or at exit).

Records (``grad_nf``) are rare by construction: at most ``CAP`` per DDP module and kind, then a
count at exit. ``DDPDOCTOR_GRADS=0`` turns this off (with the parameter-use digests of
``paramuse.py``).
"""

from __future__ import annotations

import math
import os
import weakref

#: ``DDPDOCTOR_GRADS=0`` turns the gradient checks off.
ENABLED = os.environ.get("DDPDOCTOR_GRADS", "1") != "0"
#: Records of one kind per DDP module before only counting.
CAP = 5
#: Backward passes between two checks after the first ones (``DDPDOCTOR_GRADS_EVERY``; default
#: 1: every backward, so that the first non-finite one and its ranks are exact).
EVERY = max(1, int(os.environ.get("DDPDOCTOR_GRADS_EVERY", "1") or 1))
FIRST = 3
_isfinite = math.isfinite

#: "hook": the global optimizer pre hook's handle while armed (_arm), else None
_state: dict = {"mods": [], "opt": weakref.WeakKeyDictionary(), "installed": False, "hook": None}


class _Grads:
    """Per DDP module: its index, the non-finite backward awaiting an optimizer step, counts."""

    def __init__(self, rec, idx: int, ddp) -> None:
        self.rec = rec
        self.idx = idx
        self.ref = weakref.ref(ddp)
        self.ptrs = {p.data_ptr() for p in ddp.module.parameters()}
        self.pending_step = 0  # a non-finite backward with no optimizer step or skip seen yet
        self.pending_site = None
        self.device: list = []  # (step, site, host scalar, event) of accelerator checks in flight
        self.counts: dict[str, int] = {}
        self.paramuse = None  # paramuse.Used for find_unused_parameters models
        self.fast = None  # the dtype of a CPU float32/float64 output gradient seen before
        self.quiet = False  # fast known, nothing pending, no paramuse, no step hook armed

    def __call__(self, grad, step: int, site) -> None:
        """DDP's backward reached the model's output (``grad``: the gradient there, local)."""
        if EVERY > 1 and step > FIRST and step % EVERY:
            if self.paramuse is not None:
                self.paramuse.on_backward(step, site)
            return
        try:
            if self.quiet and grad.dtype is self.fast and grad.is_cpu:
                # the common case, kept short: one reduction, one read
                if not _isfinite(grad.sum().item()):
                    self._found(grad, step, site)
                return
            self._check(grad, step, site)
        except Exception as exc:
            self.rec.internal_error(exc)

    def _check(self, grad, step: int, site) -> None:
        if self.pending_step:
            self._settle("none")
        if self.device:
            self._poll(False)
        if grad is not None and grad.is_floating_point() and not grad.is_sparse:
            s = grad.sum(dtype=_f32()) if grad.element_size() < 4 else grad.sum()
            if s.device.type == "cpu":
                if grad.element_size() >= 4:
                    self.fast = grad.dtype
                if not _isfinite(s.item()):
                    self._found(grad, step, site)
            else:
                self._defer(step, site, s)
        if self.paramuse is not None:
            self.paramuse.on_backward(step, site)
        if _state["hook"] is not None:
            _disarm_if_idle()  # here, in a backward: never inside torch's loop over the pre hooks
        self.quiet = self.fast is not None and not (self.pending_step or self.device) \
            and self.paramuse is None and _state["hook"] is None

    def _found(self, grad, step: int, site) -> None:
        """The sum of the output gradient was not finite (rare path): NaN, Inf, or only a sum of
        large finite values that overflowed, which is no finding."""
        torch = _torch()
        if bool(torch.isnan(grad).any()):
            self._local(step, site, "nan")
        elif not bool(torch.isfinite(grad).all()):
            self._local(step, site, "inf")

    def _count(self, kind: str) -> bool:
        n = self.counts[kind] = self.counts.get(kind, 0) + 1
        return n <= CAP

    def _emit(self, at: str, step: int, site, **fields) -> None:
        rec = self.rec
        if rec.writer is None or not rec.enabled:
            return
        rec.emit(dict({"t": "grad_nf", "id": self.idx, "at": at, "step": step, "ts": rec.now_us(),
                       "site": site}, **fields))

    def _local(self, step: int, site, kind: str, late: bool = False) -> None:
        """This rank's gradient at the output was non-finite at backward ``step`` (rare path)."""
        if not late:
            self.pending_step, self.pending_site = step, site
            self.quiet = False
            _arm()
        if not self._count("local"):
            return
        ddp = self.ref()
        pnf = ddp is not None and _nonfinite(list(ddp.module.parameters())) > 0
        self._emit("local", step, site, kind=kind, pnf=int(pnf), **({"late": 1} if late else {}))

    def _defer(self, step: int, site, s) -> None:
        import torch

        try:
            host = torch.empty((), dtype=s.dtype, pin_memory=True)
            host.copy_(s, non_blocking=True)
            event = getattr(torch, s.device.type).Event()
            event.record()
        except Exception:  # no pinned memory or events on this device: read it now
            if not math.isfinite(s.item()):
                self._local(step, site, "nonfinite")
            return
        self.device.append((step, site, host, event))
        self.quiet = False
        _arm()

    def _poll(self, wait: bool) -> None:
        keep = []
        for step, site, host, event in self.device:
            if wait:
                event.synchronize()
            elif not event.query():
                keep.append((step, site, host, event))
                continue
            if not math.isfinite(host.item()):
                # known only now, maybe after an optimizer step went by: no apply/skip of its own
                # (a later non-finite parameter check tells whether it was applied)
                self._local(step, site, "nonfinite", late=True)
        self.device = keep

    def _settle(self, how: str, n: int = 0, names=(), site=None) -> None:
        """What became of the pending non-finite backward on this rank: ``apply`` (an optimizer
        step applied ``n`` non-finite gradients), ``none`` (no step before the next backward or
        exit), ``scaler`` (a GradScaler skipped it), ``finite`` (the step's gradients were finite)."""
        step, self.pending_step = self.pending_step, 0
        at = "apply" if how == "apply" else "skip"
        if self._count(at):
            fields = {"n": n, "names": list(names)[:8]} if at == "apply" else {"how": how}
            self._emit(at, step, self.pending_site if site is None else site, **fields)

    def at_exit(self) -> None:
        if self.paramuse is not None:
            self.paramuse.at_exit()
        if self.device:
            self._poll(False)  # never wait for a device at exit: it may be stuck in a collective
        if self.pending_step:
            self._settle("none")
        over = {k: n for k, n in self.counts.items() if n > CAP}
        if over:
            self._emit("count", 0, -1, counts=over)
        ddp = self.ref()
        if ddp is not None and _nonfinite([_sample(p) for p in ddp.module.parameters() if p.is_cpu]):
            self._emit("exit", 0, -1, pnf=1)  # a step that applied them after the last backward


def _torch():
    import torch

    return torch


def _f32():
    return _torch().float32


def _sample(t):
    """At most 64 elements of ``t`` (a strided view): what the exit check looks at, once."""
    try:
        flat = t.detach().reshape(-1)
        return flat[:: max(1, flat.numel() // 64)][:64]
    except Exception:
        return None


def _nonfinite(tensors) -> int:
    """How many of ``tensors`` hold a NaN or Inf (rare path: called only after a non-finite one)."""
    import torch

    n = 0
    with torch.no_grad():
        for t in tensors:
            if t is not None and t.is_floating_point() and not t.is_sparse and t.numel() \
                    and not bool(torch.isfinite(t).all()):
                n += 1
    return n


def on_ddp_init(rec, ddp, info: dict) -> None:
    """A DDP module was constructed: follow its backward passes (``info['grads']`` is called by
    the backward hook of ``patches/ddp.py``)."""
    if not ENABLED:
        return
    try:
        _install()
        g = _Grads(rec, len(_state["mods"]), ddp)
        _state["mods"].append(g)
        _state["opt"].clear()
        from . import paramuse

        g.paramuse = paramuse.attach(rec, g.idx, ddp)
        info["grads"] = g
    except Exception as exc:
        rec.internal_error(exc)


def _install() -> None:
    if _state["installed"]:
        return
    _state["installed"] = True
    import atexit

    # the optimizer pre hook is armed only while a non-finite backward awaits its step (_arm)
    _wrap_scaler()
    atexit.register(_at_exit)


def _arm() -> None:
    """A non-finite backward (or an accelerator check in flight) awaits the next optimizer step:
    hook the steps until it is settled. Only then: armed for good, a global pre hook was a
    Python call on every step of every optimizer (~3k instructions, issue #11)."""
    if _state["hook"] is not None:
        return
    try:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _state["hook"] = register_optimizer_step_pre_hook(_before_step)
    except ImportError:  # older torch: the next backward or exit settles it ("none")
        pass


def _disarm_if_idle() -> None:
    """Remove the step pre hook once nothing awaits a step. Called from a backward, never from
    the hook itself: torch iterates the hook dict while calling it, and removing an entry then
    raises for a hook registered after ours."""
    h = _state["hook"]
    if h is not None and not any(g.pending_step or g.device for g in _state["mods"]):
        _state["hook"] = None
        h.remove()


def _mods_of(opt) -> list[_Grads]:
    try:
        mods = _state["opt"].get(opt)
        if mods is None:
            try:
                ptrs = {p.data_ptr() for g in opt.param_groups for p in g["params"]}
            except Exception:
                ptrs = set()
            mods = _state["opt"][opt] = [g for g in _state["mods"] if g.ptrs & ptrs]
        return mods
    except TypeError:  # an optimizer that cannot be weakly referenced: not followed
        return []


def _before_step(opt, args, kwargs) -> None:
    """Global optimizer pre-step hook: O(1) unless a non-finite backward awaits this step."""
    for g in _mods_of(opt):
        if g.device:
            g._poll(False)
        if not g.pending_step:
            continue
        try:
            if kwargs and ("found_inf" in kwargs or "grad_scaler" in kwargs):
                g._settle("scaler")  # a fused optimizer told by its GradScaler to skip inf steps
                continue
            params = [p for grp in opt.param_groups for p in grp["params"] if p.grad is not None]
            names = _names_of(g, params)
            bad = [i for i, p in enumerate(params) if _nonfinite([p.grad])]
            rec = g.rec
            site = rec.sites.current(3) if rec.writer is not None else None
            if bad:
                g._settle("apply", len(bad), [names[i] for i in bad if i < len(names)], site)
            else:
                g._settle("finite")
        except Exception as exc:
            g.rec.internal_error(exc)


def _names_of(g: _Grads, params) -> list[str]:
    ddp = g.ref()
    if ddp is None:
        return []
    by_ptr = {p.data_ptr(): n for n, p in ddp.module.named_parameters()}
    return [by_ptr.get(p.data_ptr(), "?") for p in params]


def _wrap_scaler() -> None:
    """``GradScaler`` skips ``optimizer.step()`` when it found Inf/NaN: record the skip."""
    try:
        from torch.amp import grad_scaler
    except Exception:
        return
    from . import WRAPPED

    cls = grad_scaler.GradScaler
    orig = getattr(cls, "_maybe_opt_step", None)
    if orig is None or getattr(orig, WRAPPED, False):
        return

    def _maybe_opt_step(self, optimizer, optimizer_state, *args, **kwargs):
        mods = [g for g in _mods_of(optimizer) if g.pending_step]
        if mods:
            try:
                found = sum(v.item() for v in optimizer_state["found_inf_per_device"].values())
            except Exception:
                found = 0
            if found:
                for g in mods:
                    g._settle("scaler")
        return orig(self, optimizer, optimizer_state, *args, **kwargs)

    setattr(_maybe_opt_step, WRAPPED, True)
    cls._maybe_opt_step = _maybe_opt_step


def _at_exit() -> None:
    for g in _state["mods"]:
        try:
            g.at_exit()
        except Exception as exc:
            g.rec.internal_error(exc)
