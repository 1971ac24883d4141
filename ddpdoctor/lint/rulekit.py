"""What the static rules share: the rule-family base class and small helpers over the syntax
tree (canonical names of calls, arguments, the statement blocks and loops of a function)."""

from __future__ import annotations

import ast
from typing import Iterator

from ..source.flow import stmt_exit
from ..source.program import Program
from ..source.units import Func
from .comm import Comm, CommModel


class RuleFamily:
    """A family of rules (one module each): ``rules()`` lists them as (check id, rule, words one
    of which a module's source must contain for the rule to apply). A rule takes one function
    and yields findings."""

    def __init__(self, prog: Program, cm: CommModel) -> None:
        self.prog = prog
        self.cm = cm


def canon_of(func: Func, node: ast.AST) -> str:
    """The canonical dotted name of a call's function (``dist.x`` -> ``torch.distributed.x``), or ""."""
    return (func.module.imports.canonical(node) or "").replace(".distributed_c10d.", ".")


def calls_of(func: Func) -> list[ast.Call]:
    """The function's calls in source order."""
    return func.call_nodes


def argument(call: ast.Call, idx: int, kw: str | None = None) -> ast.AST | None:
    """The argument at position ``idx``, else the keyword ``kw``, else None."""
    if len(call.args) > idx and not isinstance(call.args[idx], ast.Starred):
        return call.args[idx]
    if kw is not None:
        for k in call.keywords:
            if k.arg == kw:
                return k.value
    return None


def unparsed(node: ast.AST | None) -> str | None:
    """The source text of an expression (a key to compare paths by), or None."""
    if node is None:
        return None
    try:
        return ast.unparse(node)
    except Exception:  # pragma: no cover - unparse handles every expression of a parsed file
        return None


def strip_module(node: ast.AST) -> ast.AST:
    """``model.module.module`` -> ``model`` (DDP's wrapped module is the same model)."""
    while isinstance(node, ast.Attribute) and node.attr == "module":
        node = node.value
    return node


def stmt_leaves(s: ast.stmt) -> bool:
    """Whether the statement always leaves its block (return/raise/break/continue/exit)."""
    return stmt_exit(s) is not None


def has_p2p_or_sync(cm: CommModel, s: ast.stmt, func: Func) -> bool:
    """Whether the statement makes a communicating library call itself (a collective or a
    point-to-point call, on any group), not counting calls into the analysed code."""
    for call in cm.calls_in(s, func):
        c = cm.classify(call, func)
        if isinstance(c, Comm):
            return True
    return False


def blocks_of(func: Func) -> list[list[ast.stmt]]:
    """Every statement block of the function (its body, branches, loop bodies), cached."""
    got = func.__dict__.get("_blocks")
    if got is None:
        got = func.__dict__["_blocks"] = list(_blocks_gen(func))
    return got


def _blocks_gen(func: Func) -> Iterator[list[ast.stmt]]:
    node = func.node
    if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef)):
        yield node.body
    for n in func.scope:
        for field in ("body", "orelse", "finalbody"):
            sub = getattr(n, field, None)
            if isinstance(sub, list) and sub and isinstance(sub[0], ast.stmt):
                yield sub


def loops_of(func: Func) -> list:
    """(loop, enclosing loop or None) for every loop of the function, cached."""
    got = func.__dict__.get("_loops")
    if got is None:
        got = func.__dict__["_loops"] = _loops_with_outer(func.node)
    return got


def _loops_with_outer(node: ast.AST):
    """(loop, enclosing loop or None) for every for/while loop in the scope."""
    out = []

    def visit(n, outer):
        for child in ast.iter_child_nodes(n):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                continue
            if isinstance(child, (ast.For, ast.AsyncFor, ast.While)):
                out.append((child, outer))
                visit(child, child)
            else:
                visit(child, outer)

    visit(node, None)
    return out
