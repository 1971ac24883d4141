"""An in-process recording session (``ddpdoctor.check()`` inside an initialised job, without the
launcher): start recording into a folder now, stop and close the file later.

Kept apart from the recorder so that the recorder imports none of the patches (the patches import
the recorder)."""

from __future__ import annotations

import dataclasses

from .patches.groups import _after_init


def start(rec, out: str, hang_timeout: float | None = None, on_hang: str | None = None,
          run_id: str | None = None) -> str | None:
    """Start recording now into ``out``. Returns the trace file's path, or None if no process
    group exists."""
    from torch.distributed import distributed_c10d as c10d

    if not c10d.is_initialized():
        return None
    changes: dict = {"out": out}
    if hang_timeout is not None:
        changes["hang_timeout"] = float(hang_timeout)
    if on_hang is not None:
        changes["on_hang"] = on_hang
    if run_id is not None:
        changes["run_id"] = run_id
    rec.settings = dataclasses.replace(rec.settings, **changes)
    rec.enabled = True
    rec.discard_pending()  # what happened before the block is not part of it
    _after_init(rec, None, agree_run_id=False)
    return rec.writer.path if rec.writer is not None else None


def end(rec) -> str | None:
    """Stop recording (the watchdog too) and close the file; returns its path."""
    path = rec.writer.path if rec.writer is not None else None
    if rec.watchdog is not None:
        rec.watchdog.stop()
        rec.watchdog = None
    if rec.writer is not None:
        rec.writer.close()
        rec.writer = None
    if rec.slot is not None:
        rec.slot.close()
        rec.slot = None
    rec.seq.clear()
    rec.p2p.clear()
    return path
