"""Finding the user's call site: the first frames outside torch, ddpdoctor and the stdlib glue.

A manual frame walk (a few µs) instead of ``traceback.extract_stack`` (about 3x slower). Call
sites are interned: each distinct stack is described once in the trace (a ``site`` record) and
events refer to it by id, which keeps events small and the hot path to a dict lookup.
"""

from __future__ import annotations

import linecache
import os
import sys
import sysconfig
import threading
from types import FrameType

from . import sourceinfo

_HERE = os.path.dirname(os.path.abspath(__file__)) + os.sep
#: Frames under these prefixes are never the user's call site.
_SKIP_PREFIXES: list[str] = [_HERE]
_SKIP_NAMES = ("<frozen ", "<string>")
#: The standard library is glue too (tempfile, importlib, threading...), but not the
#: site-packages that may live under it.
_STDLIB = tuple({os.path.dirname(os.__file__) + os.sep, sysconfig.get_paths()["stdlib"] + os.sep})
#: nn.Module call plumbing: never the interesting library entry point.
_CALL_MACHINERY = frozenset({"_wrapped_call_impl", "_call_impl", "inner", "_fn", "decorate_context"})
#: How many user frames are kept per site (innermost first when walking).
STACK_DEPTH = 6


def add_skip_prefix(path: str) -> None:
    path = os.path.dirname(os.path.abspath(path)) + os.sep
    if path not in _SKIP_PREFIXES:
        _SKIP_PREFIXES.append(path)


def _is_library(filename: str, cache: dict[str, bool] = {}) -> bool:  # noqa: B006 - a cache
    hit = cache.get(filename)
    if hit is None:
        hit = (filename.startswith(tuple(_SKIP_PREFIXES)) or filename.startswith(_SKIP_NAMES)
               or (filename.startswith(_STDLIB) and "-packages" + os.sep not in filename))
        cache[filename] = hit
    return hit


class SiteTable:
    """Interns call stacks; emits a ``site`` record through ``emit`` the first time one is seen."""

    def __init__(self, emit) -> None:
        self._emit = emit
        self._ids: dict[tuple, int] = {}
        self._lock = threading.Lock()
        self.records: dict[int, dict] = {}

    def current(self, skip: int = 2) -> int:
        """Id of the call site of the caller's caller (frames of libraries skipped)."""
        try:
            f: FrameType | None = sys._getframe(skip)
        except ValueError:
            return -1
        key: list = []
        lib_frames: list = []
        n = 0
        while f is not None and n < STACK_DEPTH:
            code = f.f_code
            if _is_library(code.co_filename):
                if not key and len(lib_frames) < 8:
                    lib_frames.append((code, f.f_lineno))
            else:
                key.append((code, f.f_lineno))
                n += 1
            f = f.f_back
        tkey = tuple(key)
        sid = self._ids.get(tkey)
        if sid is None:
            sid = self._new(tkey, lib_frames)
        return sid

    def _new(self, key: tuple, lib_frames: list) -> int:
        with self._lock:
            sid = self._ids.get(key)
            if sid is not None:
                return sid
            sid = len(self._ids)
            stack = []
            for code, line in key:
                fn = code.co_filename
                stack.append([fn, line, code.co_name, linecache.getline(fn, line).strip()])
            rec: dict = {"t": "site", "id": sid}
            if stack:
                rec.update(file=stack[0][0], line=stack[0][1], func=stack[0][2], src=stack[0][3])
            else:
                rec.update(file="?", line=0, func="?", src="")
            rec["stack"] = stack
            entry = [(c, ln) for c, ln in lib_frames if not c.co_filename.startswith(_HERE)
                     and c.co_name not in _CALL_MACHINERY]
            if entry:
                # The library function the user line called into (a metric, an optimizer...).
                code, line = entry[-1]
                rec["via"] = f"{code.co_name} ({os.path.basename(code.co_filename)}:{line})"
            conds = sourceinfo.conditions_for_stack([(s[0], s[1]) for s in stack])
            if conds:
                rec["conds"] = conds
            self._ids[key] = sid
            self.records[sid] = rec
        self._emit(rec)
        return sid
