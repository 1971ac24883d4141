"""``ddpdoctor lint``: find distributed bugs in the source, before anything runs.

The analysed code is parsed with ``ast``, never imported or executed. Which values and
conditions depend on the rank is ``ddpdoctor.source`` (shared with the trace analysis;
:func:`condition_is_rank_dependent` is re-exported here). Modules, one job each: ``config``
(files, ``[tool.ddpdoctor.lint]``), ``comm`` (what communicates), ``structure`` (communication
under rank-dependent conditions), ``simulate`` (ranks simulated for constant world sizes),
``rules`` and its families ``rules_collectives``, ``rules_files``, ``rules_data``, ``rules_ddp``
(the other checks; shared helpers in ``rulekit``), ``catalog`` (ids, categories, titles),
``suppress`` (``# ddpdoctor: ignore[..]``), ``engine`` (running it all), ``output`` and ``sarif``
(text, JSON, SARIF 2.1.0), ``cli`` (the command's body). This package imports nothing of
ddpdoctor's rank side (no torch either).
"""

from __future__ import annotations

from ..source.rankdep import Verdict, condition_is_rank_dependent
from .engine import LintResult, lint

__all__ = ["LintResult", "Verdict", "condition_is_rank_dependent", "lint"]
