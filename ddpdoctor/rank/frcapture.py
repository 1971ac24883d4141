"""At a hang, each traced rank also writes its PyTorch Flight Recorder buffer next to its trace.

The buffer holds what ddpdoctor's Python wrappers do not see: DDP's C++ bucket all-reduces and
internal broadcasts, each with its Python stack. ``ddpdoctor report`` reports the ddpdoctor traces
and names the dumps; ``--run fr`` reads them. ``DDPDOCTOR_FR_DUMP=0`` turns it off.

Dumping runs in its own short-lived daemon thread, never in the watchdog's: torch's first dump
in a process spends seconds preparing stack symbolization (it releases the GIL meanwhile), so
the watchdog warms it up once a call has waited half the hang timeout, and the dump at the hang
itself then takes milliseconds. Nothing here raises: a failure only means no dump.
"""

from __future__ import annotations

import os
import threading

ENV = "DDPDOCTOR_FR_DUMP"
#: torch's own naming, <prefix><rank>, so the report reads the rank from the name.
NAME = "fr_trace_rank_{rank:05d}"
_lock = threading.Lock()
_warmed = False


def _enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def _fr():
    try:
        import torch

        return getattr(torch._C._distributed_c10d, "_dump_fr_trace", None)
    except Exception:
        return None


def dump(out: str | None, rank: int) -> str | None:
    """Write this rank's FR buffer into ``out`` (in the calling thread); the path, or None."""
    if not out or not _enabled():
        return None
    fn = _fr()
    if fn is None:
        return None
    try:
        with _lock:  # one dump at a time per process
            data = fn()
        if not data:
            return None
        path = os.path.join(out, NAME.format(rank=rank))
        part = os.path.join(out, "." + NAME.format(rank=rank) + ".part")
        with open(part, "wb") as f:
            f.write(data)
        os.replace(part, path)
        return path
    except Exception:  # a private torch API: whatever it does, the hang report goes on
        return None


def dump_async(out: str | None, rank: int) -> None:
    """``dump`` in a daemon thread."""
    if out and _enabled():
        threading.Thread(target=dump, args=(out, rank), name="ddpdoctor-fr-dump", daemon=True).start()


def warm() -> None:
    """Once per process: a dump thrown away, so that the one at a hang is quick."""
    global _warmed
    if _warmed or not _enabled():
        return
    _warmed = True
    fn = _fr()
    if fn is None:
        return

    def run() -> None:
        try:
            with _lock:
                fn()
        except Exception:
            pass

    threading.Thread(target=run, name="ddpdoctor-fr-warm", daemon=True).start()
