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

from ..trace import sourceinfo

_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # the ddpdoctor package
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
#: An object's identity without id(), which raises an audit event (a Python call into every
#: audit hook, ours included) on each use: the default hash is derived from the address alone.
_identity = object.__hash__


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
        # Hot path, keyed by object identity: hashing a code object hashes its constants (for
        # a module, every nested function's code) and f_lineno decodes the line table, each
        # call. _codes holds every code object seen, so no identity in these keys is reused.
        self._codes: dict[int, object] = {}  # identity -> code
        self._lib: dict[int, bool] = {}  # identity of a code -> is a library frame
        self._at: dict[tuple, int] = {}  # see at(): (code identity, f_lasti, caller's f_lasti) -> id

    def current(self, skip: int = 2) -> int:
        """Id of the call site of the caller's caller (frames of libraries skipped)."""
        try:
            f: FrameType | None = sys._getframe(skip)
        except ValueError:
            return -1
        return self.at(f)

    def at(self, f: FrameType) -> int:
        """Id of the call site of a call made from frame ``f`` (library frames skipped).

        The hot path of every recorded call, so the full walk (``_walk``: up to STACK_DEPTH user
        frames, line numbers, the site record) runs once per key. The key is the first user
        frame's code and instruction offset (an instruction maps to one line) plus the
        instruction offset in *its* caller: a helper called from two lines of one function
        gets two sites, as the divergence checks need (each context has its own branch
        conditions). Only the caller's offset, not its code: ``f_code`` and ``sys._getframe``
        each raise an audit event, a Python call into every audit hook (fileaudit's included),
        while ``f_lasti``/``f_back`` do not. Callers further out are not in the key: the same
        helper line reached through the same call line from two different grandparents is one
        site, whose stack is the one seen first. Frames are classified by ``_is_library``
        alone, once per code object."""
        start = f
        code = f.f_code
        cid = _identity(code)
        is_lib = self._lib.get(cid)
        if is_lib is None:
            is_lib = self._classify(code, cid)
        while is_lib:  # a call made by a library (FSDP, DDP's join...): find the user's frame
            b = f.f_back
            if b is None:
                break
            f = b
            code = f.f_code
            cid = _identity(code)
            is_lib = self._lib.get(cid)
            if is_lib is None:
                is_lib = self._classify(code, cid)
        b = f.f_back
        key = (cid, f.f_lasti, -1 if b is None else b.f_lasti)
        sid = self._at.get(key)
        if sid is None:
            sid = self._walk(0, start)  # from the call itself: the library entry ("via") too
            if len(self._at) < 100000:
                self._at[key] = sid
        return sid

    def _classify(self, code, cid: int) -> bool:
        if len(self._codes) >= 100000:  # bounded; clearing all three keeps every key valid
            self._at.clear()
            self._lib.clear()
            self._codes.clear()
        self._codes[cid] = code
        is_lib = self._lib[cid] = _is_library(code.co_filename)
        return is_lib

    def _walk(self, skip: int, frame: FrameType | None = None) -> int:
        """``current`` by source line: interns the stack on first sight."""
        f: FrameType | None = frame
        if f is None:
            try:
                f = sys._getframe(skip)
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
