"""Existence checks on paths (``os.path.exists``/``isfile``/``isdir``, ``Path.exists``/``is_file``,
``os.stat``): reads for the missing-barrier check.

Python raises no audit event for the stat family, so ``os.stat`` is wrapped: ``genericpath`` and
``pathlib`` look it up on the ``os`` module at each call, so one wrapper covers them all. The
wrapper runs the real call first, then raises a ``ddpdoctor.stat`` audit event (path, whether it
was missing) that the file hook (``files.py``) records like a read. ``os.listdir``,
``os.scandir`` and ``glob.glob`` raise their own audit events and need no wrapper. The import
system uses ``posix.stat`` directly and is never seen here.
"""

from __future__ import annotations

import functools
import os
import sys

from . import WRAPPED


def install(rec) -> None:
    """Wrap ``os.stat`` once; the wrapper steps aside (one attribute read) when not recording."""
    orig = os.stat
    if getattr(orig, WRAPPED, False):
        return
    from .. import recorder as recorder_mod

    rec_get = recorder_mod.get
    audit = sys.audit
    fspath = os.fspath

    @functools.wraps(orig)
    def stat(path, *args, **kwargs):
        r = rec_get()
        if r is None or r.writer is None or not r.enabled or isinstance(path, int) \
                or getattr(r.local, "in_audit", False) or kwargs.get("dir_fd") is not None:
            return orig(path, *args, **kwargs)
        try:
            result = orig(path, *args, **kwargs)
        except FileNotFoundError:
            _report(audit, fspath, path, True)
            raise
        _report(audit, fspath, path, False)
        return result

    setattr(stat, WRAPPED, True)
    # Code that asks whether os.stat supports dir_fd/follow_symlinks (shutil.rmtree's safe
    # variant) must get the same answer for the wrapper, or it would take another path.
    for support in ("supports_dir_fd", "supports_fd", "supports_follow_symlinks", "supports_effective_ids"):
        s = getattr(os, support, None)
        if isinstance(s, set) and orig in s:
            s.add(stat)
    os.stat = stat


def _report(audit, fspath, path, missing: bool) -> None:
    try:
        p = fspath(path)
    except TypeError:
        return
    if isinstance(p, bytes):
        p = os.fsdecode(p)
    audit("ddpdoctor.stat", p, missing)
