"""Digests of every DDP replica's parameters and buffers, for the replica-drift check.

DDP's invariant is identical parameters on every rank after each step. A digest is taken right
after construction (after DDP's initial broadcast), after each of the first optimizer steps, every
``DDPDOCTOR_REPLICA_EVERY`` steps (default 100), before each ``torch.save`` (a checkpoint) and at
a normal exit. Each tensor contributes a strided sample of at most 64 elements (its exact bits,
CRC-32) and its in-place version counter, never its contents; so a digest costs a few µs per
tensor and nothing at all between the points above (a step count per optimizer step, kept by
the optimizer's own post hook: stephooks.py).
On an accelerator the samples are copied to pinned memory asynchronously and the record is written
once the copy has completed (checked at the next point, at the latest at exit): a digest never
waits for the device. ``load_state_dict`` into a DDP module (or the module it wraps) is recorded
too, to tell what last wrote a parameter that differs.
"""

from __future__ import annotations

import functools
import os
import weakref
import zlib

from . import WRAPPED, stephooks

#: Elements sampled per tensor.
SAMPLE = 64
#: Steps between two digests after the first ones.
EVERY = max(1, int(os.environ.get("DDPDOCTOR_REPLICA_EVERY", "100") or 100))
#: The first optimizer steps, each digested (drift usually starts at once).
FIRST = 3

_state: dict = {"mods": [], "installed": False, "pending": []}


class _Replica:
    """What is kept per DDP module: its index in this process, steps so far, the last versions."""

    def __init__(self, idx: int, ddp) -> None:
        self.idx = idx
        self.ref = weakref.ref(ddp)
        self.inner = weakref.ref(ddp.module)
        self.steps = 0
        self.due = 1  # the next step count at which after_step runs (_set_due)
        ignore = set(getattr(ddp, "parameters_to_ignore", ()) or ())
        self.pnames = [n for n, _ in ddp.module.named_parameters() if n not in ignore]
        self.bnames = [n for n, _ in ddp.module.named_buffers() if n not in ignore]
        self.ignore = ignore
        self.ptrs = {p.data_ptr() for n, p in ddp.module.named_parameters() if n not in ignore}


#: ``DDPDOCTOR_REPLICAS=0`` turns the digests off.
ENABLED = os.environ.get("DDPDOCTOR_REPLICAS", "1") != "0"


def on_ddp_init(rec, ddp) -> None:
    """A DDP module was constructed (its parameters just broadcast): first digest."""
    from . import batchnorm

    batchnorm.on_ddp_init(rec, ddp, len(_state["mods"]) if ENABLED else len(batchnorm._state["ddp"]))
    if not ENABLED:
        return
    try:
        _install(rec)
        rep = _Replica(len(_state["mods"]), ddp)
        _state["mods"].append(rep)
        stephooks.new_ddp_module()  # optimizers' module lists are recomputed
        _digest(rec, rep, "init", extra={"names": rep.pnames, "bnames": rep.bnames,
                                         "bb": bool(getattr(ddp, "broadcast_buffers", True))})
    except Exception as exc:
        rec.internal_error(exc)


def _install(rec) -> None:
    if _state["installed"]:
        return
    _state["installed"] = True
    _bind_get()
    import atexit

    import torch

    # steps are counted by each optimizer's own post hook (stephooks.py), which calls after_step
    # when a digest is due
    _wrap_save(torch)
    _wrap_load(torch)
    atexit.register(_at_exit)


def _rec():
    rec = _get()
    if rec is None or rec.writer is None or not rec.enabled:
        return None
    return rec


def _get():
    from .. import recorder as recorder_mod

    return recorder_mod.get()


def _bind_get() -> None:
    """The per-step hook reads the recorder without an import statement each call."""
    global _get
    from .. import recorder as recorder_mod

    _get = recorder_mod.get


def after_step(rep: _Replica) -> None:
    """An optimizer step that updated ``rep`` is over and reached ``rep.due`` (its post hook,
    stephooks.py, counted it): digest on schedule, finish pending copies, set the next due step."""
    rec = _rec()
    if rec is None:
        return
    try:
        if _state["pending"]:
            _flush(rec, wait=False)
        if rep.steps <= FIRST or rep.steps % EVERY == 0:
            _digest(rec, rep, "step")
        _set_due()
    except Exception as exc:
        rec.internal_error(exc)


def _next_due(steps: int) -> int:
    return steps + 1 if steps < FIRST else (steps // EVERY + 1) * EVERY


def _set_due() -> None:
    """Each module's next step that needs ``after_step``: the next digest, or the next step at
    all while accelerator copies are pending (they are flushed there)."""
    pending = bool(_state["pending"])
    for rep in _state["mods"]:
        rep.due = rep.steps + 1 if pending else _next_due(rep.steps)


def modules_of(opt) -> tuple:
    """The DDP modules this optimizer updates (recomputed when a DDP module is constructed)."""
    if not ENABLED or not _state["mods"]:
        return ()
    return tuple(_modules_of(opt))


def _modules_of(opt) -> list[_Replica]:
    """The DDP modules whose parameters this optimizer updates (once per optimizer)."""
    try:
        ptrs = {p.data_ptr() for g in opt.param_groups for p in g["params"]}
    except Exception:
        return []
    out = [rep for rep in _state["mods"] if rep.ref() is not None and rep.ptrs & ptrs]
    if type(opt).__name__ == "PostLocalSGDOptimizer":  # replicas differ between averagings by design
        return []
    return out


def _sample(t):
    try:
        flat = t.detach().reshape(-1)
        n = flat.numel()
        if n > SAMPLE:
            flat = flat[:: max(1, n // SAMPLE)][:SAMPLE]
        out = flat.contiguous().view(-1).view(_uint8())
        if out.device.type != "meta":
            return out
    except Exception:  # sparse, quantized, meta: no sample (its version counter still counts)
        pass
    import torch

    return torch.empty(0, dtype=torch.uint8)


@functools.lru_cache(maxsize=1)
def _uint8():
    import torch

    return torch.uint8


def _digest(rec, rep: _Replica, at: str, extra: dict | None = None) -> None:
    import torch

    ddp = rep.ref()
    if ddp is None:
        return
    mod = ddp.module
    named_p = [(n, p) for n, p in mod.named_parameters() if n not in rep.ignore]
    named_b = [(n, b) for n, b in mod.named_buffers() if n not in rep.ignore]
    tensors = [p for _, p in named_p] + [b for _, b in named_b]
    if not tensors:
        return
    with torch.no_grad():
        samples = [_sample(t) for t in tensors]
        sizes = [int(s.numel()) for s in samples]
        versions = [int(getattr(t, "_version", 0)) for t in tensors]
        site = rec.sites.current(3)
        base = {"t": "replica", "id": rep.idx, "at": at, "step": rep.steps, "ts": rec.now_us(), "site": site}
        if extra:
            base.update(extra)
        meta = (base, len(named_p), sizes, versions)
        devices = {s.device.type for s in samples}
        if devices == {"cpu"}:
            _emit(rec, meta, torch.cat(samples).numpy().tobytes())
            return
        # an accelerator: copy asynchronously, write the record once the copy is done
        dev = next(s.device for s in samples if s.device.type != "cpu")
        flat = torch.cat([s.to(dev) for s in samples])
        host = torch.empty(flat.numel(), dtype=torch.uint8, pin_memory=True)
        host.copy_(flat, non_blocking=True)
        event = None
        try:
            mod_dev = getattr(torch, flat.device.type)
            event = mod_dev.Event()
            event.record()
        except Exception:
            event = None
        _state["pending"].append((meta, host, flat, event))
        _set_due()  # flushed at the next optimizer step


def _emit(rec, meta, data: bytes) -> None:
    base, np_, sizes, versions = meta
    crcs = []
    off = 0
    for k in sizes:
        crcs.append(f"{zlib.crc32(data[off:off + k]):08x}")
        off += k
    p, b = crcs[:np_], crcs[np_:]
    rec.emit(dict(base, fp=f"{zlib.crc32(''.join(p).encode()):08x}", bfp=f"{zlib.crc32(''.join(b).encode()):08x}",
                  p=p, b=b, pv=versions[:np_], bv=versions[np_:]))


def _flush(rec, wait: bool) -> None:
    keep = []
    for meta, host, flat, event in _state["pending"]:
        done = True
        if event is not None:
            if wait:
                event.synchronize()
            else:
                done = bool(event.query())
        if done:
            _emit(rec, meta, host.numpy().tobytes())
        else:
            keep.append((meta, host, flat, event))
    _state["pending"] = keep


def _wrap_save(torch) -> None:
    """A checkpoint: digest every DDP module before it is written."""
    orig = torch.save
    if getattr(orig, WRAPPED, False):
        return

    @functools.wraps(orig)
    def save(*args, **kwargs):
        rec = _rec()
        if rec is not None and _state["mods"]:
            try:
                for rep in _state["mods"]:
                    _digest(rec, rep, "save")
            except Exception as exc:
                rec.internal_error(exc)
        return orig(*args, **kwargs)

    setattr(save, WRAPPED, True)
    torch.save = save
    try:
        import torch.serialization as ser

        if getattr(ser, "save", None) is orig:
            ser.save = save
    except Exception:
        pass


def _wrap_load(torch) -> None:
    """``load_state_dict`` into a DDP module or the module it wraps: a write of its parameters."""
    cls = torch.nn.Module
    orig = cls.load_state_dict
    if getattr(orig, WRAPPED, False):
        return

    @functools.wraps(orig)
    def load_state_dict(self, *args, **kwargs):
        result = orig(self, *args, **kwargs)
        if _state["mods"]:
            rec = _rec()
            if rec is not None:
                try:
                    for rep in _state["mods"]:
                        if self is rep.ref() or self is rep.inner():
                            rec.emit({"t": "replica_w", "id": rep.idx, "how": "load", "step": rep.steps,
                                      "ts": rec.now_us(), "site": rec.sites.current(2)})
                except Exception as exc:
                    rec.internal_error(exc)
        return result

    setattr(load_state_dict, WRAPPED, True)
    cls.load_state_dict = load_state_dict


def _at_exit() -> None:
    rec = _rec()
    if rec is None:
        return
    try:
        for rep in _state["mods"]:
            _digest(rec, rep, "exit")
        _flush(rec, wait=True)
    except Exception as exc:
        rec.internal_error(exc)


stephooks.HOOKS.modules_of = modules_of  # the optimizers' post hooks call these
stephooks.HOOKS.after_step = after_step
