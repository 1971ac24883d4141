"""Warnings keep the location they have in a plain run.

A library function that warns with ``stacklevel=2`` or more names a frame above itself, usually
the user's line. When one of ddpdoctor's wrappers sits between that frame and the library
function, the count ends inside the wrapper instead: the warning names a ddpdoctor file, and
Python's "default" action, which shows a warning once per location, folds the warnings of every
call site into one (the wrapper's). ``warnings.warn`` is replaced by a function that steps over
ddpdoctor's own frames while it counts ``stacklevel``, so a warning is attributed, filtered and
deduplicated exactly as without ddpdoctor. It runs only when something warns, never per call,
and falls back to the caller's own ``stacklevel`` if anything in the walk goes wrong.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable

from . import native

# Every file of the package: the rank-side wrappers, and anything they call back into.
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_state: dict[str, Callable | None] = {"real": None}


def adjusted_level(stacklevel: int, start) -> int:
    """The ``stacklevel`` that, counted from ``start`` (the frame that called ``warn``), names
    the frame a plain run would name: one more for each ddpdoctor frame passed on the way up."""
    frame, extra = start, 0
    for _ in range(stacklevel - 1):
        if frame is None:
            break
        frame = frame.f_back
        while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
            frame = frame.f_back
            extra += 1
    return stacklevel + extra


def _native():
    """The C replacement (``_warnsite``), unless ``DDPDOCTOR_NATIVE=0`` or not built."""
    return native.load("_warnsite")


def install(native: bool = True) -> None:
    """Replace ``warnings.warn`` once per process (idempotent). The C function where it was built
    (torch 2.13 calls warn on every all_gather_into_tensor / reduce_scatter_tensor: a Python
    replacement cost ~8k instructions a call there), else the Python one below."""
    if _state["real"] is not None:
        return
    real = warnings.warn
    _state["real"] = real
    mod = _native() if native else None
    if mod is not None:
        try:
            mod.install(real, _PACKAGE)
            warnings.warn = mod.warn
            return
        except Exception:  # noqa: BLE001 - fall back to the Python function
            pass

    def warn(message, category=None, stacklevel=1, source=None, **kwargs):
        level = stacklevel
        if isinstance(stacklevel, int):  # anything else: the real warn's own TypeError
            if stacklevel > 1:
                try:
                    level = adjusted_level(stacklevel, sys._getframe(1))
                except Exception:  # the warning must be raised whatever the walk met
                    level = stacklevel
            else:
                level = 1  # 1 and below name warn's caller
            level += 1  # this function's own frame
        return real(message, category, level, source, **kwargs)

    warn.__doc__ = real.__doc__
    warn.__wrapped__ = real  # type: ignore[attr-defined]
    warnings.warn = warn
