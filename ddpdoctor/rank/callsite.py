"""Finding the user's call site: the first frames outside torch, ddpdoctor, installed packages
(site-packages, dist-packages) and the standard library, however deep the library code is.

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
from . import native

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


#: Installed third-party code (Lightning, accelerate, transformers...): context, never the user's line.
_PACKAGES = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)


def _is_library(filename: str, cache: dict[str, bool] = {}) -> bool:  # noqa: B006 - a cache
    """Whether a frame of ``filename`` is library code: the user's call site is the first frame
    (from the call inwards out) that is not. An editable install (``pip install -e``) runs from
    the user's folder, so it stays the user's code."""
    hit = cache.get(filename)
    if hit is None:
        hit = (filename.startswith(tuple(_SKIP_PREFIXES)) or filename.startswith(_SKIP_NAMES)
               or filename.startswith(_STDLIB) or any(p in filename for p in _PACKAGES))
        cache[filename] = hit
    return hit


def _frame_kind(filename: str) -> int:
    """0: the user's code; 1: library code; 2: an installed package other than torch (Lightning,
    accelerate...), library code that tells apart two calls from the same user line (part of a
    site's identity, so that its ``via``/``lib`` are those of the call)."""
    if not _is_library(filename):
        return 0
    if any(p in filename for p in _PACKAGES) and not filename.startswith(tuple(_SKIP_PREFIXES)):
        return 2
    return 1


def _package(filename: str) -> str:
    """The top-level package of an installed file (``accelerate`` for
    ``.../site-packages/accelerate/utils/operations.py``), else the file's base name."""
    for p in _PACKAGES:
        i = filename.rfind(p)
        if i >= 0:
            return filename[i + len(p):].split(os.sep, 1)[0].removesuffix(".py")
    for root in _STDLIB:
        if filename.startswith(root):
            return filename[len(root):].split(os.sep, 1)[0].removesuffix(".py")
    return os.path.basename(filename)


#: Library frames kept as context per site: the outermost (what the user's line called) and
#: the innermost (what reached the recorded call).
LIB_CONTEXT = 6


def library_context(lib_frames: list) -> tuple[list[list], str | None]:
    """From the library frames between the recorded call and the user's line (innermost first,
    ``(code, line)``): the ``lib`` field (outermost first, ``[file, line, func]``, at most
    ``LIB_CONTEXT``, the middle of a deep recursion left out) and the ``via`` text: the function
    the user's line called and the innermost frame outside torch that reached the call, e.g.
    ``lightning fit (trainer.py:584) ... barrier (ddp.py:303)``."""
    frames = [(c, ln) for c, ln in reversed(lib_frames)
              if not c.co_filename.startswith(_HERE) and c.co_name not in _CALL_MACHINERY]
    if not frames:
        return [], None
    if len(frames) > LIB_CONTEXT:
        half = LIB_CONTEXT // 2
        frames = frames[:half] + frames[-half:]
    code, line = frames[0]
    via = f"{_package(code.co_filename)} {code.co_name} ({os.path.basename(code.co_filename)}:{line})"
    # ... and the innermost frame of a package other than torch: what reached the call
    inner = next(((c, ln) for c, ln in reversed(frames[1:]) if _package(c.co_filename) != "torch"), None)
    if inner is not None:
        via += f" ... {inner[0].co_name} ({os.path.basename(inner[0].co_filename)}:{inner[1]})"
    return [[c.co_filename, ln, c.co_name] for c, ln in frames], via


def _frame_source():
    """A generator whose running frame's ``f_back`` is whoever resumed it: the caller's frame
    without ``sys._getframe``, which raises an audit event (a Python call into every audit hook,
    ~3k instructions with fileaudit's, callgrind) at each use; ``f_back`` raises none. Threads
    share it: one that finds it running (ValueError) uses ``sys._getframe``."""
    me = sys._getframe()  # once, at import
    while True:
        yield me.f_back


_frames = _frame_source()
next(_frames)
#: ``resume_frames(None)`` is the frame that called it.
resume_frames = _frames.send


# ``_sitewalk.site_key`` (rank/_sitewalk.c), or None: not built, or ``DDPDOCTOR_NATIVE=0`` (the
# Python loops of ``SiteTable.at`` then build every key)
_site_key = getattr(native.load("_sitewalk"), "site_key", None)


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
        self._lib: dict[int, int] = {}  # identity of a code -> _frame_kind (0: the user's)
        self._at: dict[tuple, int] = {}  # see at(): (code identity, f_lasti, caller's f_lasti, frameworks) -> id
        self._gkind: dict[int, tuple] = {}  # identity of a frame's globals -> _classify_globals

    def current(self, skip: int = 2) -> int:
        """Id of the call site of the caller's caller (frames of libraries skipped)."""
        try:
            f: FrameType | None = resume_frames(None)  # this frame, without an audit event
        except ValueError:  # another thread is inside the generator right now
            try:
                f = sys._getframe(skip)
            except ValueError:
                return -1
        else:
            for _ in range(skip):
                f = f.f_back if f is not None else None
            if f is None:
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
        site, whose stack is the one seen first. Framework frames (``_frame_kind`` 2) between
        the call and the user's frame are in the key. Frames are classified once per code object."""
        if _site_key is not None:
            # the walk below in C for frames already classified (FSDP's collectives are 11-16
            # torch frames from the user's line: ~90 bytecodes a call in Python, issue #11)
            key = _site_key(f, self._gkind, self._lib)
            if key is not None:
                sid = self._at.get(key)
                if sid is not None:
                    return sid
        start = f
        # Frames of library modules (torch: nn.Module's call path, FSDP, DDP) are skipped by
        # their globals, which reading costs no audit event: ~3k instructions saved per frame
        # (callgrind). Only a module whose file is plain library code (kind 1) is skipped so:
        # frameworks (kind 2) are part of the key, and unknown globals get the code's verdict.
        gkind = self._gkind
        while True:
            g = f.f_globals
            k = gkind.get(_identity(g))
            if k is None:
                k = self._classify_globals(g)
            b = f.f_back
            if not k[1] or b is None:
                break
            f = b
        fw: tuple = ()
        while True:  # a call made by a library (FSDP, DDP's join...): walk out to the user's frame
            code = f.f_code
            cid = _identity(code)
            is_lib = self._lib.get(cid)
            if is_lib is None:
                is_lib = self._classify(code, cid)
            if not is_lib:
                break
            if is_lib == 2:
                # a framework between the call and the user's line (accelerate, Lightning): the
                # same user line reached through other framework code is another site
                fw += (cid, f.f_lasti)
            b = f.f_back
            if b is None:
                break
            f = b
        b = f.f_back
        key = (cid, f.f_lasti, -1 if b is None else b.f_lasti, *fw)
        sid = self._at.get(key)
        if sid is None:
            sid = self._walk(0, start)  # from the call itself: the library entry ("via") too
            if len(self._at) < 100000:
                self._at[key] = sid
        return sid

    def _classify_globals(self, g: dict) -> tuple:
        """(the globals, 1 when every code running with them is plain library code) from the
        module's ``__file__``; 0 (decide by the code) for globals without one (``exec``)."""
        if len(self._gkind) >= 100000:
            self._gkind.clear()
        fn = g.get("__file__") if isinstance(g, dict) else None
        k = (g, 1 if isinstance(fn, str) and os.path.isabs(fn) and _frame_kind(fn) == 1 else 0)
        self._gkind[_identity(g)] = k  # holds the dict: its identity is never reused meanwhile
        return k

    def _classify(self, code, cid: int) -> int:
        if len(self._codes) >= 100000:  # bounded; clearing all three keeps every key valid
            self._at.clear()
            self._lib.clear()
            self._codes.clear()
        self._codes[cid] = code
        is_lib = self._lib[cid] = _frame_kind(code.co_filename)
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
        context: list = []
        n = 0
        while f is not None and n < STACK_DEPTH:
            code = f.f_code
            kind = _frame_kind(code.co_filename)
            if kind:
                if not key and len(lib_frames) < 256:
                    lib_frames.append((code, f.f_lineno))
                    if kind == 2:
                        context.append((code, f.f_lineno))
            else:
                key.append((code, f.f_lineno))
                n += 1
            f = f.f_back
        tkey = tuple(key)
        ikey = (tkey, tuple(context))
        sid = self._ids.get(ikey)
        if sid is None:
            sid = self._new(tkey, lib_frames, ikey)
        return sid

    def _new(self, key: tuple, lib_frames: list, ikey: tuple) -> int:
        with self._lock:
            sid = self._ids.get(ikey)
            if sid is not None:
                return sid
            sid = len(self._ids)
            stack = []
            for code, line in key:
                fn = code.co_filename
                stack.append([fn, line, code.co_name, linecache.getline(fn, line).strip()])
            rec: dict = {"t": "site", "id": sid}
            lib, via = library_context(lib_frames)
            if not stack and lib:
                # No user frame at all (a framework's own thread, a test runner's hook): the
                # library frame that made the call.
                fn, ln, name = lib[-1]
                stack = [[fn, ln, name, linecache.getline(fn, ln).strip()]]
            if stack:
                rec.update(file=stack[0][0], line=stack[0][1], func=stack[0][2], src=stack[0][3])
            else:
                rec.update(file="?", line=0, func="?", src="")
            rec["stack"] = stack
            if via:
                # The library code between the user's line and the call (a metric, a framework).
                rec["via"] = via
                rec["lib"] = lib
            conds = sourceinfo.conditions_for_stack([(s[0], s[1]) for s in stack])
            if conds:
                rec["conds"] = conds
            self._ids[ikey] = sid
            self.records[sid] = rec
        self._emit(rec)
        return sid
