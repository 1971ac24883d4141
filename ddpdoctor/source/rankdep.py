"""Rank dependence, the public API: whether the condition on a line of a source file differs from
rank to rank. One implementation for the static linter (``ddpdoctor.lint``) and the offline
trace analysis: the whole file is parsed and analysed (``program``, ``flow``, ``taint``), never
imported or run."""

from __future__ import annotations

import ast
from dataclasses import dataclass

from .program import Program
from .taint import describe, is_heuristic

_CONDITIONS = (ast.If, ast.While, ast.For, ast.AsyncFor, ast.Assert, ast.IfExp)


@dataclass(frozen=True)
class Verdict:
    """Whether a condition differs across ranks: ``state`` is ``yes``, ``no`` or ``unknown``;
    ``sure`` is False when the answer rests on a spelling only; ``reason`` says why."""

    state: str
    reason: str
    sure: bool = True

    def __bool__(self) -> bool:
        return self.state == "yes"


def condition_is_rank_dependent(source_text: str, lineno: int, filename: str = "<source>") -> Verdict:
    """Whether the condition on line ``lineno`` of ``source_text`` is rank-dependent.

    The condition is the test of an ``if``/``elif``/``while``/conditional expression/``assert``
    or the iterable of a ``for`` that starts on that line. ``unknown`` when the source does not
    parse or no condition starts there. The whole file is analysed (values flow from anywhere in
    it), nothing is imported or run. One implementation for the linter and the trace analysis.
    """
    key = (filename, hash(source_text))
    prog = _PROGRAMS.get(key)
    if prog is None:
        try:
            prog = Program.from_sources({filename: source_text})
        except SyntaxError as exc:
            return Verdict("unknown", f"the source does not parse: {exc.msg} (line {exc.lineno})")
        except (ValueError, RecursionError) as exc:
            return Verdict("unknown", f"the source cannot be analysed ({type(exc).__name__})")
        if len(_PROGRAMS) >= 32:  # a small cache: a trace analysis asks about many lines of few files
            _PROGRAMS.pop(next(iter(_PROGRAMS)))
        _PROGRAMS[key] = prog
    return condition_verdict(prog, filename, lineno)


_PROGRAMS: dict = {}


def condition_verdict(prog: Program, path: str, lineno: int) -> Verdict:
    """The verdict on the condition starting on line ``lineno`` of ``path``, one of the files
    ``prog`` analysed (the linter asks this of the program it already built)."""
    module = next((m for m in prog.modules if m.path == path), None)
    if module is None:
        return Verdict("unknown", f"{path} is not among the analysed files")
    node = None
    for n in ast.walk(module.tree):
        if isinstance(n, _CONDITIONS) and getattr(n, "lineno", 0) == lineno:
            node = n
            break
    if node is None:
        return Verdict("unknown", f"no condition starts on line {lineno}")
    func = prog.func_at(module, lineno)
    if isinstance(node, ast.IfExp):
        t = prog.taint(func, node.test)
    else:  # if/while/assert: the test; for: the iterable (both recorded by the walk)
        t = prog.test_taint(func, node)
    if not t:
        return Verdict("no", "no value in the condition depends on the rank")
    return Verdict("yes", f"depends on the rank through {describe(t)}", sure=not is_heuristic(t))
