"""Data and randomness: what the unseeded-rng and sampler-misuse checks compare across ranks.

Recorded at the few points that matter, never per tensor op: explicit seeding
(``torch.manual_seed``), data splits (``random_split``), each epoch of a ``DistributedSampler``
(seed, epoch, dataset length, a digest of the indices it yields), optimizer construction
(a digest of the parameter values it will train) and each optimizer's first ``step()`` (the
parameters it actually starts from, after any DDP or manual broadcast, and a digest of the
gradients: identical on every rank exactly when the program synchronises them).
"""

from __future__ import annotations

import functools
import weakref
import zlib

from .. import recorder as recorder_mod
from . import WRAPPED, stephooks

_MARK = WRAPPED


def _digest(values, limit: int = 4096) -> str:
    data = ",".join(str(int(v)) for v in list(values)[:limit])
    return format(zlib.crc32(data.encode()), "08x")


def _rec():
    rec = recorder_mod.get()
    if rec is None or not rec.enabled or getattr(rec.local, "depth", 0):
        return None
    return rec


def _wrap(owner, name: str, make):
    orig = getattr(owner, name, None)
    if orig is None or getattr(orig, _MARK, False):
        return
    new = functools.wraps(orig)(make(orig))
    setattr(new, _MARK, True)
    setattr(owner, name, new)


def patch() -> None:
    import torch
    import torch.utils.data as tud
    from torch.utils.data import dataset as ds_mod
    from torch.utils.data.distributed import DistributedSampler

    def make_seed(orig):
        def manual_seed(seed):
            rec = _rec()
            if rec is not None:
                try:
                    rec.emit({"t": "seed", "gen": "torch", "value": int(seed), "ts": rec.now_us(),
                              "site": rec.sites.current(2)})
                except Exception as exc:
                    rec.internal_error(exc)
            return orig(seed)
        return manual_seed

    _wrap(torch, "manual_seed", make_seed)

    def make_split(orig):
        def random_split(dataset, lengths, generator=None):
            result = orig(dataset, lengths, generator) if generator is not None else orig(dataset, lengths)
            rec = _rec()
            if rec is not None:
                try:
                    rec.emit({"t": "split", "n": len(dataset), "parts": [len(s) for s in result],
                              "fp": [_digest(s.indices) for s in result],
                              "gen": "explicit" if generator is not None else "default",
                              "ts": rec.now_us(), "site": rec.sites.current(2)})
                except Exception as exc:
                    rec.internal_error(exc)
            return result
        return random_split

    _wrap(ds_mod, "random_split", make_split)
    if getattr(tud, "random_split", None) is not None:
        tud.random_split = ds_mod.random_split

    def make_iter(orig):
        def __iter__(self):
            it = orig(self)
            rec = _rec()
            if rec is None:
                return it
            try:
                indices = list(it)
                ds = self.dataset
                sub = getattr(ds, "indices", None)
                rec.emit({
                    "t": "sampler", "id": id(self) & 0xFFFFFF, "epoch": int(getattr(self, "epoch", 0)),
                    "seed": int(getattr(self, "seed", 0)), "shuffle": bool(getattr(self, "shuffle", False)),
                    "n": len(ds), "num_samples": int(getattr(self, "num_samples", len(indices))),
                    "total": int(getattr(self, "total_size", 0)), "replicas": int(self.num_replicas),
                    "srank": int(self.rank), "drop_last": bool(getattr(self, "drop_last", False)),
                    "fp": _digest(indices), "data_fp": _digest(sub) if sub is not None else None,
                    "created": getattr(self, "_ddpdoctor_site", None),
                    "ts": rec.now_us(), "site": rec.sites.current(2)})
                return iter(indices)
            except Exception as exc:
                rec.internal_error(exc)
                return it
        return __iter__

    _wrap(DistributedSampler, "__iter__", make_iter)

    def make_sampler_init(orig):
        def __init__(self, *args, **kwargs):
            orig(self, *args, **kwargs)
            rec = _rec()
            if rec is not None:
                try:
                    self._ddpdoctor_site = rec.sites.current(2)
                except Exception:
                    pass
        return __init__

    _wrap(DistributedSampler, "__init__", make_sampler_init)

    def make_set_epoch(orig):
        def set_epoch(self, epoch):
            rec = _rec()
            if rec is not None:
                try:
                    rec.emit({"t": "set_epoch", "id": id(self) & 0xFFFFFF, "epoch": int(epoch),
                              "ts": rec.now_us(), "site": rec.sites.current(2)})
                except Exception as exc:
                    rec.internal_error(exc)
            return orig(self, epoch)
        return set_epoch

    _wrap(DistributedSampler, "set_epoch", make_set_epoch)

    def make_optim(orig):
        def __init__(self, params, *args, **kwargs):
            params = list(params) if not isinstance(params, (list, tuple)) else params
            orig(self, params, *args, **kwargs)
            stephooks.on_optimizer(self)  # its first step (on_first_step) and step counts
            rec = _rec()
            if rec is not None and rec.writer is not None:
                try:
                    from .ddp import fingerprint

                    ps = [p for g in self.param_groups for p in g["params"]]
                    rec.emit({"t": "optim", "at": "init", "id": id(self) & 0xFFFFFF,
                              "cls": type(self).__name__, "nparams": len(ps),
                              "fp": fingerprint(ps), "in_ddp": _in_ddp(rec, ps), "ts": rec.now_us(),
                              "site": rec.sites.current(2)})
                except Exception as exc:
                    rec.internal_error(exc)
        return __init__

    _wrap(torch.optim.Optimizer, "__init__", make_optim)


def _sharded(ps) -> bool:
    """Parameters that are shards by design (FSDP's flat parameters, DTensors): they differ
    across ranks legitimately."""
    return any(type(p).__name__ == "FlatParameter" or hasattr(p, "_local_tensor") for p in ps)


def _in_ddp(rec, ps) -> int:
    """How many of these parameters belong to a DDP-wrapped module."""
    ddp_ptrs = set()
    for ref in rec.ddp_refs:
        mod = ref()
        if mod is not None:
            ddp_ptrs.update(p.data_ptr() for p in mod.parameters())
    return sum(1 for p in ps if p.data_ptr() in ddp_ptrs)


_stepped: weakref.WeakSet = weakref.WeakSet()


def on_first_step(opt) -> None:
    """An optimizer's first step is about to run (its own pre hook, stephooks.py, removed once
    that step is over): record the parameters and gradients it starts from."""
    try:
        if opt in _stepped:  # a first step that raised: its pre hook was left in place
            return
        _stepped.add(opt)
    except TypeError:  # an unhashable optimizer subclass: not recorded
        return
    rec = _rec()
    if rec is None or rec.writer is None:
        return
    try:
        from .ddp import fingerprint

        ps = [p for g in opt.param_groups for p in g["params"]]
        grads = [p.grad for p in ps if p.grad is not None]
        rec.emit({"t": "optim", "at": "step", "id": id(opt) & 0xFFFFFF, "cls": type(opt).__name__,
                  "nparams": len(ps), "fp": fingerprint(ps),
                  "gfp": fingerprint(grads) if grads else "none", "in_ddp": _in_ddp(rec, ps),
                  "sharded": _sharded(ps), "ts": rec.now_us(), "site": rec.sites.current(3)})
    except Exception as exc:
        rec.internal_error(exc)


stephooks.HOOKS.first_step = on_first_step  # each optimizer's first-step pre hook calls it
