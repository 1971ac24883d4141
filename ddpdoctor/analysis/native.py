"""The optional C extensions of the offline side (setup.py, ``optional=True``), loaded like the
rank side's (``DDPDOCTOR_NATIVE=0`` or a build without a compiler gives the Python paths); a
module of its own because the analysis side never imports ``ddpdoctor.rank``."""

from __future__ import annotations

import importlib
import os
from types import ModuleType


def load(name: str) -> ModuleType | None:
    """``ddpdoctor.analysis.<name>`` (e.g. ``_bulkscan``), or None: not built, or turned off with
    ``DDPDOCTOR_NATIVE=0``."""
    if os.environ.get("DDPDOCTOR_NATIVE", "1").strip() == "0":
        return None
    try:
        return importlib.import_module(f"{__package__}.{name}")
    except ImportError:
        return None
