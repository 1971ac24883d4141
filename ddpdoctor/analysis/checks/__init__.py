"""The catalogue of checks. Each check is one module here with one ``Check`` subclass (found
automatically); its documentation and a bad/good example pair live under the repository's
``checks/<category>/``."""

from __future__ import annotations

import importlib
import pkgutil

from .base import Check, Context

__all__ = ["Check", "Context", "all_checks"]


def all_checks() -> list[Check]:
    """One instance of every check, ordered by id."""
    classes: dict[str, type] = {}
    for mod in pkgutil.iter_modules(__path__):
        if mod.name == "base" or mod.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{mod.name}")
        for obj in vars(module).values():
            if isinstance(obj, type) and issubclass(obj, Check) and obj is not Check \
                    and obj.__module__ == module.__name__:
                classes[obj.id] = obj
    return [classes[k]() for k in sorted(classes)]
