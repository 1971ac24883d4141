"""The rank side's optional C extensions, through the one switch and loader of
``ddpdoctor.trace.native`` (``DDPDOCTOR_NATIVE=0``)."""

from __future__ import annotations

from types import ModuleType

from ..trace import native as _native


def load(name: str) -> ModuleType | None:
    """``ddpdoctor.rank.<name>`` (e.g. ``_fastcall``), or None: not built, or turned off with
    ``DDPDOCTOR_NATIVE=0``."""
    return _native.load(__package__, name)
