"""Audit hooks that cost nothing for the events they do not watch.

A hook added with ``sys.addaudithook`` is a Python call for every audit event of the process:
each ``id()`` (FSDP2's per-step ``torch._dynamo.disable`` wrappers call it ~29 times a step),
each ``frame.f_code``, ``sys._getframe``... about 2-3k instructions each (callgrind, issue #11:
~143k of an FSDP2 step's ~475k of recording cost). The optional C extension ``_auditfilter``
adds one C hook that compares the event's name with the watched ones and calls the Python hook
only for those, with the same ``(event, args)``: the same records, and an unwatched event
costs a few string comparisons. Without the extension (no compiler at install time) or with
``DDPDOCTOR_NATIVE=0``, the hook is added with ``sys.addaudithook`` as before.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable

from . import native

_native = native.load("_auditfilter")


def add_hook(hook: Callable[[str, tuple], None], events: Iterable[str]) -> bool:
    """Call ``hook(event, args)`` for audit events named in ``events``; True when the C filter
    took it. Audit hooks cannot be removed: the hook must itself tell when it has nothing to do
    (no recorder, recording off). With the C filter a later call replaces the earlier hook
    (one recorder records a process's file operations); with ``sys.addaudithook`` both stay."""
    names = tuple(events)
    if _native is not None:
        try:
            _native.install(names, hook)
            return True
        except Exception:  # noqa: BLE001 - vetoed by another hook, names it cannot hold
            pass
    sys.addaudithook(hook)
    return False
