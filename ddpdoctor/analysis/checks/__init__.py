"""The catalogue of checks. Each check is one module here with one ``Check`` subclass (found
automatically); its documentation and a bad/good example pair live under the repository's
``checks/<category>/``."""

from __future__ import annotations

from .base import Check, Context, all_checks

__all__ = ["Check", "Context", "all_checks"]
