"""ddpdoctor: diagnostics and hang detection for distributed PyTorch.

This module imports neither torch nor click: the start-up bootstrap imports it in every
Python process of a traced job (DataLoader workers, the torchrun agent...), which must stay cheap.
The public test-suite API (``check``, ``spawn``, ``DistributedBugError``) is loaded on first use.

PYTEST_DONT_REWRITE: under ``ddpdoctor trace -- pytest`` this package is imported before pytest
loads its plugin, which would otherwise warn that it cannot assert-rewrite it.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["check", "spawn", "DistributedBugError", "__version__"]


def __getattr__(name: str):
    if name in ("check", "spawn", "DistributedBugError"):
        from . import testing

        return getattr(testing, name)
    raise AttributeError(f"module 'ddpdoctor' has no attribute {name!r}")
