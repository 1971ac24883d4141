"""The test-suite API: ``check()``, ``spawn()``, ``DistributedBugError``.

``check`` (``testing.block``) runs inside the ranks of an initialised job; ``spawn``
(``testing.spawner``) starts the ranks itself. The pytest plugin (``ddpdoctor.pytest_plugin``)
stays outside this package so that loading it imports neither this package nor torch."""

from __future__ import annotations

from ..errors import DistributedBugError
from .block import check
from .spawner import spawn, spawn_defaults

__all__ = ["check", "spawn", "spawn_defaults", "DistributedBugError"]
