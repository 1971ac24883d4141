"""How a rank ended: normal exit, an uncaught exception (with its line), or a signal.

Every hook chains to what was there before and changes nothing about how the program fails.
"""

from __future__ import annotations

import atexit
import faulthandler
import os
import signal
import sys
import traceback

from ...trace import files, records
from .. import callsite


def _user_frame(tb) -> tuple[str, int, str]:
    """Innermost frame of a traceback that is the user's, not a library's."""
    best = ("?", 0, "?")
    for fs in traceback.extract_tb(tb):
        if not callsite._is_library(fs.filename):
            best = (fs.filename, fs.lineno or 0, fs.name)
    return best


def exception_exit(rec, exc: BaseException, inflight: list, **extra) -> dict:
    """The ``exit`` record of an uncaught exception: its message, the user's line, the stack."""
    file, line, func = _user_frame(exc.__traceback__)
    stack = [[fs.filename, fs.lineno, fs.name, (fs.line or "").strip()]
             for fs in traceback.extract_tb(exc.__traceback__)[-8:]]
    return records.exit_record("exception", exc=f"{type(exc).__name__}: {exc}"[:1000], file=file, line=line,
                               func=func, stack=stack, ts=rec.now_us(), inflight=inflight, **extra)


def normal_exit(rec, **extra) -> dict:
    """The ``exit`` record of a rank that ended normally: its position and pending async work."""
    return records.exit_record("normal", ts=rec.now_us(), events=rec.events, seq=rec.position(),
                               pending_async=len(rec.async_pending), **extra)


def record_exception(rec, exc: BaseException) -> None:
    if rec.exit_recorded or isinstance(exc, SystemExit):
        return
    try:
        info = exception_exit(rec, exc, records.inflight_list(rec.inflight))
        rec.emit(info)
        rec.exit_recorded = True
        rec.exit_info = {k: info[k] for k in ("how", "exc", "file", "line", "func")}
        if rec.watchdog is not None:
            rec.watchdog.publish_exit({k: info[k] for k in ("how", "exc", "file", "line", "func")})
        if rec.writer is not None:
            rec.writer.sync()
    except Exception:
        pass


def install(rec) -> None:
    if "exit" in rec.installed:
        return
    rec.installed.add("exit")
    prev_hook = sys.excepthook

    def excepthook(etype, value, tb):
        record_exception(rec, value)
        prev_hook(etype, value, tb)

    sys.excepthook = excepthook

    finished = []

    def at_exit():
        if finished:  # atexit and multiprocessing's exit function may both call it
            return
        finished.append(True)
        # Run from multiprocessing's `finally` (below), the target's exception is in flight.
        exc = sys.exc_info()[1]
        if exc is not None:
            record_exception(rec, exc)
        clean = False
        # After an output fault (outfault) the exit record still goes to the in-flight slot.
        if not rec.exit_recorded and (rec.writer is not None or rec.output_fault is not None):
            rec.exit_recorded = True
            try:
                rec.emit(normal_exit(rec))
                clean = True
                if rec.watchdog is not None:
                    rec.watchdog.publish_exit({"how": "exited normally", "seq": rec.position()})
            except Exception:
                pass
        if rec.watchdog is not None:
            rec.watchdog.stop()
        rec.close()
        if clean and rec.output_fault is None:  # after an output fault the slot holds what was kept
            _tidy(rec)

    atexit.register(at_exit)
    _register_mp_exit(at_exit)
    _install_signal_dumps(rec)


def _tidy(rec) -> None:
    """After a normal exit the sidecar files hold nothing: the in-flight file (the rank is inside
    no call any more) and an empty stack dump are removed, so a clean run leaves its traces only.
    faulthandler keeps its descriptor: a crash later in teardown writes to the unlinked file."""
    slot = rec.slot  # left mapped: a thread still in a call writes to the unlinked file
    try:
        if slot is not None:
            os.unlink(slot.path)
        sf = rec.stacks_file
        if sf is not None:
            sf.flush()
            if os.path.getsize(sf.name) == 0:
                os.unlink(sf.name)
    except (OSError, ValueError):
        pass


def _register_mp_exit(at_exit) -> None:
    """A multiprocessing child (mp.Process, mp.spawn) catches its target's exception itself
    (sys.excepthook never sees it) and a forked one leaves through os._exit (atexit never
    runs); both run multiprocessing's exit function first, in a ``finally`` around the
    target: hook ``at_exit`` there too. Forked children start with that registry cleared."""
    try:
        import multiprocessing
        from multiprocessing import util

        if multiprocessing.parent_process() is not None:
            util.Finalize(None, at_exit, exitpriority=-100)
    except Exception:
        pass


def _install_signal_dumps(rec) -> None:
    """On SIGTERM (what launchers send first) and SIGUSR2 (ours, on demand), write every
    thread's Python stack from C, which works even while the main thread is blocked in a
    collective and cannot run a Python signal handler. Chains to the previous handler."""
    if rec.writer is None:
        return
    path = files.stacks_path(rec.writer.path)
    try:
        from ...trace.outfault import open_private

        rec.stacks_file = open_private(path, append=True)  # stays open for faulthandler
        for sig in (signal.SIGTERM, signal.SIGUSR2):
            if sig == signal.SIGTERM and signal.getsignal(sig) not in (signal.SIG_DFL, None):
                continue  # the program handles SIGTERM itself: leave it alone
            faulthandler.register(sig, file=rec.stacks_file, all_threads=True,
                                  chain=sig == signal.SIGTERM)
        if not faulthandler.is_enabled():
            # A rank that crashes in C++ (gloo aborts on mismatched sizes) leaves its Python
            # stack here; the process still dies exactly as it would have.
            faulthandler.enable(file=rec.stacks_file, all_threads=True)
    except (OSError, RuntimeError, ValueError):
        pass


def _spawn_module():
    """The module torch.multiprocessing.spawn (``import ... as`` would give the function
    ``torch.multiprocessing.spawn`` that shadows it)."""
    import importlib

    return importlib.import_module("torch.multiprocessing.spawn")


def _spawn_wrap(fn, i, args, error_file):
    """Child-side entry of torch.multiprocessing.spawn, recording the worker's exception."""
    tmp_spawn = _spawn_module()

    from .. import recorder as recorder_mod

    def fn_recorded(idx, *a):
        try:
            return fn(idx, *a)
        except BaseException as exc:
            rec = recorder_mod.get()
            if rec is not None and not isinstance(exc, SystemExit):
                record_exception(rec, exc)
            raise

    # Where this child runs uninstrumented, torch's own entry is still in place.
    orig = getattr(tmp_spawn, "_ddpdoctor_orig_wrap", None) or tmp_spawn._wrap
    return orig(fn_recorded, i, args, error_file)


def wrap_spawn_worker() -> None:
    """torch.multiprocessing.spawn catches the worker's exception and exits 1, so the excepthook
    never sees it: wrap the child-side entry to record it first. ``_spawn_wrap`` is module-level
    so that it pickles by reference into the children."""
    try:
        tmp_spawn = _spawn_module()
    except Exception:
        return
    if getattr(tmp_spawn, "_ddpdoctor_orig_wrap", None) is None and hasattr(tmp_spawn, "_wrap"):
        tmp_spawn._ddpdoctor_orig_wrap = tmp_spawn._wrap
        tmp_spawn._wrap = _spawn_wrap
