"""The catalogue of checks. Each check is one module with one ``Check`` subclass; its
documentation and a bad/good example pair live under the repository's ``checks/<category>/``."""

from __future__ import annotations

from .base import Check, Context

__all__ = ["Check", "Context", "all_checks"]


def all_checks() -> list[Check]:
    from . import divergent, mismatch

    classes = [divergent.DivergentCollectives, mismatch.CollectiveMismatch]
    try:  # checks added by other modules register themselves in base.REGISTRY
        from . import registry_extra  # noqa: F401
    except ImportError:
        pass
    from .base import REGISTRY

    seen = {c.id for c in classes}
    classes += [c for c in REGISTRY if c.id not in seen]
    return [c() for c in classes]
