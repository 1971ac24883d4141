"""Turning instrumentation on in a process: a post-import hook that patches torch.distributed
as soon as torch finishes importing (``import torch`` imports torch.distributed and DDP), before
any user module can bind ``from torch.distributed import all_reduce``.

The hook itself is a meta-path finder that answers for one module name only, so processes that
never import torch (the launcher's helpers, tools) pay one dict lookup per import.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
import threading

_WATCHED = ("torch",)
_done = False
_lock = threading.Lock()


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self._busy = threading.local()

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _WATCHED or getattr(self._busy, "on", False):
            return None
        self._busy.on = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy.on = False
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        orig_exec = loader.exec_module

        def exec_module(module):
            orig_exec(module)
            on_torch_imported()

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def on_torch_imported() -> None:
    """Patch everything once torch is importable; idempotent, and never raises."""
    global _done
    with _lock:
        if _done:
            return
        _done = True
    try:
        import torch

        from . import callsite, recorder

        callsite.add_skip_prefix(torch.__file__)
        rec = recorder.install()
        from . import warnsite

        warnsite.install()  # library warnings name the user's line, not a ddpdoctor wrapper
        from .patches import data as patch_data
        from .patches import ddp as patch_ddp
        from .patches import dist as patch_dist
        from .patches import exit as exithooks

        if not patch_dist.patch():
            return
        from .patches import compiled as patch_compiled

        patch_compiled.patch()  # before the patches that register what to do at torch.compile
        patch_ddp.patch()
        patch_data.patch()
        from .patches import coverage as patch_coverage

        patch_coverage.patch()
        from .patches import pyrng as patch_pyrng  # Python / NumPy seeds and set-up draws

        patch_pyrng.patch()
        exithooks.wrap_spawn_worker()
        os.register_at_fork(after_in_child=_after_fork_in_child)
        del rec
    except Exception as exc:  # never break the user's import of torch
        print(f"ddpdoctor: instrumentation disabled: {type(exc).__name__}: {exc}", file=sys.stderr)
        if os.environ.get("DDPDOCTOR_DEBUG"):
            raise


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker, an mp.Process rank) starts with a fresh recorder:
    it shares nothing with the parent's file, threads or locks, and gets a file of its own only
    if it initialises a process group itself."""
    from . import recorder

    old = recorder._recorder
    recorder._recorder = None
    recorder._lock = threading.Lock()
    rec = recorder.install(old.settings if old is not None else None)
    if old is not None:
        rec.installed = set(old.installed)  # the hooks themselves are inherited through fork
    if old is not None and old.writer is not None:
        # The parent is a rank: this is its worker (DataLoader, pool), never a rank itself.
        rec.enabled = False
        # The parent's exit hooks still hold its recorder: in this child they must neither
        # write into the parent's file (an exit record from a plain os.fork() child) nor
        # touch the parent's watchdog, nor dump this child's stacks as the rank's.
        old.enabled = False
        old.writer = None
        old.watchdog = None
        try:
            import faulthandler
            import signal

            for sig in (signal.SIGTERM, signal.SIGUSR2):
                faulthandler.unregister(sig)
        except (ImportError, AttributeError, ValueError):
            pass


def install_import_hook() -> None:
    if "torch" in sys.modules:
        on_torch_imported()
        return
    if not any(isinstance(f, _PostImportFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImportFinder())


def activate_in_process() -> None:
    """Instrument the current process now (used by ``ddpdoctor.check`` without the launcher)."""
    on_torch_imported()
