"""In-flight entries whose call is over although nothing removed them.

A DDP backward's in-flight entry is removed by an autograd-engine callback that runs when the
backward completes; when the backward raises (and the program catches it and goes on) that
callback never runs, and the stale entry would make the watchdog diagnose a hang in a healthy
program. The truth is on the thread's stack: an entry for a backward is live only while the
thread that made it is still inside autograd's backward.
"""

from __future__ import annotations

import sys

#: Functions of torch.autograd whose frame is on the stack for as long as a backward runs.
_BACKWARD_FUNCS = frozenset({"_engine_run_backward", "backward", "grad"})


def _inside_backward(frame) -> bool:
    depth = 0
    while frame is not None and depth < 400:
        code = frame.f_code
        if code.co_name in _BACKWARD_FUNCS and "autograd" in code.co_filename:
            return True
        frame = frame.f_back
        depth += 1
    return False


def drop_stale(rec) -> None:
    """Remove backward entries whose thread has left autograd's backward. A thread without
    Python frames (an autograd device thread running in C++) cannot be judged: kept."""
    keys = [k for k in list(rec.inflight) if isinstance(k, tuple) and k and k[0] == "ddp_bwd"]
    if not keys:
        return
    frames = sys._current_frames()
    for k in keys:
        frame = frames.get(k[1]) if len(k) > 1 else None
        if frame is not None and not _inside_backward(frame):
            rec.inflight.pop(k, None)
