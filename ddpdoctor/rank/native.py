"""The optional C extensions of the rank side (setup.py, ``optional=True``): one switch and one
loader for all of them, so that ``DDPDOCTOR_NATIVE=0`` or a build without a compiler gives the
Python paths everywhere alike."""

from __future__ import annotations

import importlib
import os
from types import ModuleType


def load(name: str) -> ModuleType | None:
    """``ddpdoctor.rank.<name>`` (e.g. ``_fastcall``), or None: not built, or turned off with
    ``DDPDOCTOR_NATIVE=0``."""
    if os.environ.get("DDPDOCTOR_NATIVE", "1").strip() == "0":
        return None
    try:
        return importlib.import_module(f"{__package__}.{name}")
    except ImportError:
        return None
