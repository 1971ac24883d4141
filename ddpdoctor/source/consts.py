"""Literal values and the tests they decide: ``decide(test, {"rank": -1})`` is False for
``rank not in [-1, 0]``. Only literals, names bound to literals and comparisons of them are
read; anything else is undecided (None). Used by the linter for a helper's parameters given as
constants (``lint.callconsts``) and by the flow analysis (``flow.Walker.took_broadcast``)."""

from __future__ import annotations

import ast
import operator

MISSING = object()
_CMP = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
        ast.Gt: operator.gt, ast.GtE: operator.ge, ast.Is: operator.is_, ast.IsNot: operator.is_not,
        ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b}
_LITERALS = (int, float, str, bool, type(None))


def literal(node: ast.AST, consts: dict):
    """The value of a literal (or of a parameter bound to one), else MISSING."""
    if isinstance(node, ast.Constant) and isinstance(node.value, _LITERALS):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        v = literal(node.operand, consts)
        return -v if isinstance(v, (int, float)) and not isinstance(v, bool) else MISSING
    if isinstance(node, ast.Name):
        return consts.get(node.id, MISSING)
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        vals = [literal(e, consts) for e in node.elts]
        if any(v is MISSING for v in vals):
            return MISSING
        return frozenset(vals) if isinstance(node, ast.Set) else tuple(vals)
    return MISSING


def decide(test: ast.AST, consts: dict):
    """True/False when ``test`` reads only ``consts`` and literals; None when undecided."""
    if not consts:
        return None
    if isinstance(test, ast.BoolOp):
        vals = [decide(v, consts) for v in test.values]
        if isinstance(test.op, ast.And):
            if any(v is False for v in vals):
                return False
            return True if all(v is True for v in vals) else None
        if any(v is True for v in vals):
            return True
        return False if all(v is False for v in vals) else None
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        v = decide(test.operand, consts)
        return None if v is None else not v
    if isinstance(test, ast.Compare):
        left = literal(test.left, consts)
        if left is MISSING:
            return None
        for op, right_node in zip(test.ops, test.comparators):
            right = literal(right_node, consts)
            fn = _CMP.get(type(op))
            if right is MISSING or fn is None:
                return None
            try:
                ok = fn(left, right)
            except TypeError:
                return None
            if not ok:
                return False
            left = right
        return True
    v = literal(test, consts)
    return None if v is MISSING else bool(v)
