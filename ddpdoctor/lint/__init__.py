"""``ddpdoctor lint``: find distributed bugs in the source, before anything runs.

The analysed code is parsed with ``ast``, never imported or executed. Modules, one job each:
``config`` (files, ``[tool.ddpdoctor.lint]``), ``comm`` (what communicates), ``structure`` (communication under
rank-dependent conditions), ``rules`` (the other checks), ``suppress`` (``# ddpdoctor: ignore[..]``),
``engine`` (running it all), ``output`` and ``sarif`` (text, JSON, SARIF 2.1.0).
This package imports nothing of ddpdoctor's rank side (no torch either).
"""

from __future__ import annotations

from ..source.rankdep import Verdict, condition_is_rank_dependent
from .engine import LintResult, lint

__all__ = ["LintResult", "Verdict", "condition_is_rank_dependent", "lint"]
