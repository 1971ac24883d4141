"""Source analysis of distributed PyTorch programs, shared by the static linter
(``ddpdoctor.lint``) and the offline trace analysis: which values and conditions depend on the
rank. The analysed code is parsed with ``ast``, never imported or executed.

Modules, one job each, lowest first: ``names`` (dotted spellings, import aliases), ``taint``
(the rank-dependence primitives: sources, sinks, the expression evaluator), ``units`` (a parsed
file, a function), ``flow`` (one walk over a function in statement order), ``program`` (the
files' functions and classes, calls resolved between them, the whole-program fixpoint),
``rankdep`` (the public API: :func:`condition_is_rank_dependent`).

This package sits below ``analysis``, ``verdict`` and ``lint`` in the import layers
(``pyproject.toml``) and imports nothing else of ddpdoctor (no torch either).
"""

from __future__ import annotations

from .rankdep import Verdict, condition_is_rank_dependent

__all__ = ["Verdict", "condition_is_rank_dependent"]
