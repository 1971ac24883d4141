"""Whether a branch condition is rank-dependent, for the trace analysis and the live diagnosis.

One implementation for ``ddpdoctor lint`` and the trace analysis: the taint analysis of
``ddpdoctor.source.rankdep.condition_is_rank_dependent`` (whole file, ``ast`` only, nothing
imported or run), which sits below this layer. Tests can put a fake in its place with
:func:`set_backend`. Asked only when a finding is made (never per event).
"""

from __future__ import annotations

import linecache
import threading
from typing import Callable, NamedTuple, Optional


class Judgement(NamedTuple):
    """``state``: ``yes``, ``no`` or ``unknown``; ``reason``: why (for a message); ``sure``: False
    when the answer rests on a name's spelling only."""

    state: str
    reason: str = ""
    sure: bool = True


UNKNOWN = Judgement("unknown", "no analysis available")

#: (source text, line, file name) -> an object with ``state``, ``reason``, ``sure``.
Backend = Callable[[str, int, str], object]
_backend: Optional[Backend] = None
_backend_loaded = False
_cache: dict[tuple, Judgement] = {}
_lock = threading.Lock()


def _lint_backend() -> Optional[Backend]:
    # Imported on first use: parsing machinery the hot path of a rank never needs.
    from ..source.rankdep import condition_is_rank_dependent

    return condition_is_rank_dependent


def set_backend(fn: Optional[Backend]) -> None:
    """Replace the analysis (tests); ``None`` restores the linter's."""
    global _backend, _backend_loaded
    with _lock:
        _backend, _backend_loaded = fn, fn is not None
        _cache.clear()


def _get_backend() -> Optional[Backend]:
    global _backend, _backend_loaded
    with _lock:
        if not _backend_loaded:
            _backend, _backend_loaded = _lint_backend(), True
        return _backend


def judge(file: str, line: int, text: str = "") -> Judgement:
    """Whether the condition of the ``if``/``while``/``for`` header at ``file:line`` is
    rank-dependent. The whole file is analysed when it can be read; else only the header's
    ``text`` (as recorded in the trace), where names are judged by what they are bound to in it
    (nothing) and by the linter's spelling rules (``sure`` False)."""
    key = (file, int(line), text)
    hit = _cache.get(key)
    if hit is not None:
        return hit
    backend = _get_backend()
    out = UNKNOWN
    if backend is not None:
        source = "".join(linecache.getlines(file)) if file and not file.startswith("<") else ""
        lineno = int(line)
        if source and text and linecache.getline(file, lineno).strip() != text.strip():
            source = ""  # edited since the run: judge the header as recorded
        if not source and text:
            # The file is gone or elsewhere: the recorded header alone, with an empty body.
            head = text.strip().removeprefix("else of: ")
            head = "if " + head[5:] if head.startswith("elif ") else head
            source, lineno = head.rstrip(":") + ":\n    pass\n", 1
        if source:
            try:
                v = backend(source, lineno, file or "<source>")
                out = Judgement(str(getattr(v, "state", "unknown")), str(getattr(v, "reason", "")),
                                bool(getattr(v, "sure", True)))
            except Exception as exc:  # the analysis must never break a report
                out = Judgement("unknown", f"the analysis failed ({type(exc).__name__})")
    with _lock:
        if len(_cache) > 4096:
            _cache.clear()
        _cache[key] = out
    return out
