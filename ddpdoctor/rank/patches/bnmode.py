"""Train/eval mode of the BatchNorm layers of DDP modules, for the batchnorm-sync check.

A layer's mode changes through ``Module.train`` (``model.train()``, ``model.eval()``, a loop that
freezes BatchNorm layers), so that is where it is read: a wrapper of ``nn.Module.train``,
installed only once a DDP module holds BatchNorm, looks at those layers after each outermost call
and writes a ``bn`` record (``op`` ``mode``) when their modes changed, with the number of
gradient all-reduces (DDP backwards) the module has run so far. Nothing runs in forward or
backward. An assignment to ``module.training`` that bypasses ``train()`` is not seen.
"""

from __future__ import annotations

import functools
import threading
import weakref
import zlib

from .. import recorder as recorder_mod
from . import WRAPPED

_state: dict = {"mods": [], "installed": False}
_tl = threading.local()


def on_ddp_init(rec, ddp, idx: int, layers: list) -> None:
    """Watch the BatchNorm ``layers`` of a new DDP module; record their modes now."""
    try:
        _install()
        entry = {"id": idx, "ddp": weakref.ref(ddp), "layers": [weakref.ref(m) for m in layers], "last": None}
        _state["mods"].append(entry)
        _check(rec, entry, "init")
    except Exception as exc:
        rec.internal_error(exc)


def _check(rec, entry: dict, at: str) -> None:
    ddp = entry["ddp"]()
    if ddp is None:
        return
    flags = "".join("1" if m.training else "0" for m in (ref() for ref in entry["layers"]) if m is not None)
    if flags == entry["last"] and at != "exit":
        return
    entry["last"] = flags
    info = getattr(ddp, "_ddpdoctor", None) or {}
    rec.emit({"t": "bn", "op": "mode", "id": entry["id"], "at": at, "train": flags.count("1"),
              "of": len(flags), "fp": format(zlib.crc32(flags.encode()), "08x"),
              "bwd": int(info.get("bwd", 0)), "fwd": int(info.get("fwd", 0)), "ts": rec.now_us(),
              "site": rec.sites.current(4) if at != "exit" else -1})


def _rec():
    rec = recorder_mod.get()
    if rec is None or rec.writer is None or not rec.enabled:
        return None
    return rec


def _changed() -> None:
    rec = _rec()
    if rec is None:
        return
    try:
        for entry in _state["mods"]:
            _check(rec, entry, "train")
    except Exception as exc:
        rec.internal_error(exc)


def _at_exit() -> None:
    rec = _rec()
    if rec is None:
        return
    try:
        for entry in _state["mods"]:
            _check(rec, entry, "exit")
    except Exception as exc:
        rec.internal_error(exc)


def _install() -> None:
    if _state["installed"]:
        return
    _state["installed"] = True
    import atexit

    import torch.nn as nn

    orig = nn.Module.train
    if getattr(orig, WRAPPED, False):
        return

    @functools.wraps(orig)
    def train(self, *args, **kwargs):
        if getattr(_tl, "busy", False):  # a child's train() inside the outermost call
            return orig(self, *args, **kwargs)
        _tl.busy = True
        try:
            return orig(self, *args, **kwargs)
        finally:
            _tl.busy = False
            _changed()

    setattr(train, WRAPPED, True)
    nn.Module.train = train
    atexit.register(_at_exit)
