"""``ddpdoctor lint``: find distributed bugs in the source, before anything runs.

The analysed code is parsed with ``ast``, never imported or executed. Modules, one job each:
``config`` (files, ``[tool.ddpdoctor.lint]``), ``names`` (import aliases), ``rankdep`` and
``flow`` (which values and conditions depend on the rank; :func:`condition_is_rank_dependent` is
the entry point for the rest of ddpdoctor), ``program`` (the files' functions, calls between them,
the whole-program fixpoint), ``comm`` (what communicates), ``structure`` (communication under
rank-dependent conditions), ``rules`` (the other checks), ``suppress`` (``# ddpdoctor: ignore[..]``),
``engine`` (running it all), ``output`` and ``sarif`` (text, JSON, SARIF 2.1.0).
This package imports nothing of ddpdoctor's rank side (no torch either).
"""

from __future__ import annotations

from .engine import LintResult, lint
from .rankdep import Verdict, condition_is_rank_dependent

__all__ = ["LintResult", "Verdict", "condition_is_rank_dependent", "lint"]
