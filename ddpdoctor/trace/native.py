"""The switch and loader of ddpdoctor's optional C extensions (setup.py, ``optional=True``),
shared by both sides of the trace contract: ``DDPDOCTOR_NATIVE=0``, or a build without a
compiler, gives the Python paths everywhere alike, with the same results."""

from __future__ import annotations

import importlib
import os
from types import ModuleType


def enabled() -> bool:
    """False when ``DDPDOCTOR_NATIVE=0`` turns the C extensions off."""
    return os.environ.get("DDPDOCTOR_NATIVE", "1").strip() != "0"


def load(package: str, name: str) -> ModuleType | None:
    """``<package>.<name>`` (e.g. ``ddpdoctor.rank``, ``_fastcall``), or None: not built, or
    turned off."""
    if not enabled():
        return None
    try:
        return importlib.import_module(f"{package}.{name}")
    except ImportError:
        return None
