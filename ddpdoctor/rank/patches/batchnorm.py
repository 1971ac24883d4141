"""BatchNorm in DDP models, for the batchnorm-sync check: which kind of BatchNorm a DDP module
holds, the per-rank batch its BatchNorm layers normalise over, and ``convert_sync_batchnorm``
calls made after the module was wrapped.

Nothing runs per step: the layer counts are taken at DDP construction, the batch size by a forward
pre-hook on the first BatchNorm layer that removes itself after the first training-mode call, and
the conversion through a wrapper of ``SyncBatchNorm.convert_sync_batchnorm`` (a set-up call).
"""

from __future__ import annotations

import functools

from . import WRAPPED

_state: dict = {"ddp": [], "installed": False}


def on_ddp_init(rec, ddp, idx: int) -> None:
    """Record the BatchNorm layers of a new DDP module and watch the first one's first batch."""
    try:
        import torch.nn as nn

        _install()
        _state["ddp"].append((idx, ddp))
        plain = [m for m in ddp.module.modules()
                 if isinstance(m, nn.modules.batchnorm._BatchNorm) and not isinstance(m, nn.SyncBatchNorm)]
        sync = sum(1 for m in ddp.module.modules() if isinstance(m, nn.SyncBatchNorm))
        if not plain and not sync:
            return
        first = (plain or [m for m in ddp.module.modules() if isinstance(m, nn.SyncBatchNorm)])[0]
        tensor = next(iter(first.buffers()), None) if first.weight is None else first.weight
        dev = tensor.device.type if tensor is not None else "cpu"
        rec.emit({"t": "bn", "op": "layers", "id": idx, "bn": len(plain), "sbn": sync, "dev": dev,
                  "ts": rec.now_us(), "site": rec.sites.current(3)})
        from . import bnmode  # train/eval mode of these layers, read when Module.train runs

        bnmode.on_ddp_init(rec, ddp, idx, [m for m in ddp.module.modules()
                                           if isinstance(m, nn.modules.batchnorm._BatchNorm)])
        if plain:
            holder: dict = {}

            def first_batch(module, args):
                if not module.training:
                    return None
                holder["h"].remove()
                try:
                    x = args[0] if args else None
                    n = int(x.shape[0]) if getattr(x, "dim", lambda: 0)() >= 1 else None
                    rec.emit({"t": "bn", "op": "batch", "id": idx, "n": n, "ts": rec.now_us(),
                              "site": rec.sites.current(2)})
                except Exception as exc:
                    rec.internal_error(exc)
                return None

            holder["h"] = plain[0].register_forward_pre_hook(first_batch)
    except Exception as exc:
        rec.internal_error(exc)


def _install() -> None:
    if _state["installed"]:
        return
    _state["installed"] = True
    import torch.nn as nn

    cls = nn.SyncBatchNorm
    orig = cls.__dict__.get("convert_sync_batchnorm")
    func = getattr(orig, "__func__", None)
    if func is None or getattr(func, WRAPPED, False):
        return

    @functools.wraps(func)
    def convert_sync_batchnorm(klass, module, *args, **kwargs):
        _after_wrapping(module)
        return func(klass, module, *args, **kwargs)

    setattr(convert_sync_batchnorm, WRAPPED, True)
    cls.convert_sync_batchnorm = classmethod(convert_sync_batchnorm)


def _after_wrapping(module) -> None:
    """A conversion of a module that a DDP module already wraps (or of the DDP module itself)."""
    from .. import recorder as recorder_mod

    rec = recorder_mod.get()
    if rec is None or rec.writer is None or not rec.enabled or not _state["ddp"]:
        return
    try:
        for idx, ddp in _state["ddp"]:
            if module is ddp or any(module is m for m in ddp.module.modules()):
                rec.emit({"t": "bn", "op": "convert", "id": idx, "ts": rec.now_us(), "site": rec.sites.current(3)})
                return
    except Exception as exc:
        rec.internal_error(exc)
