"""The offline side's optional C extensions, through the one switch and loader of
``ddpdoctor.trace.native`` (``DDPDOCTOR_NATIVE=0``); the analysis never imports ``ddpdoctor.rank``."""

from __future__ import annotations

from types import ModuleType

from ..trace import native as _native


def load(name: str) -> ModuleType | None:
    """``ddpdoctor.analysis.<name>`` (e.g. ``_bulkscan``), or None: not built, or turned off with
    ``DDPDOCTOR_NATIVE=0``."""
    return _native.load(__package__, name)
