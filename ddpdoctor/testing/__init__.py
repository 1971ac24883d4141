"""The test-suite API: ``check()``, ``spawn()``, ``DistributedBugError``."""

from __future__ import annotations

from .api import DistributedBugError, _spawn_defaults, check, spawn

__all__ = ["check", "spawn", "DistributedBugError", "_spawn_defaults"]
