"""Constant arguments of a call into a helper, and the branches of the helper they decide.

A helper communicates or not depending on what it is given: YOLOv5's
``torch_distributed_zero_first(local_rank)`` issues a barrier only for ``local_rank not in
[-1, 0]`` or ``== 0``, and ``create_dataloader(..., rank=-1)`` enters it with -1, so that call
does not communicate at all. The communication model (``comm.CommModel``) summarises each
helper once, for every argument; here, for one call site, the parameters bound to literal
constants (given, or defaults left as they are) are found, and an ``if`` of the helper whose test
reads only those parameters and literals is decided. Anything else (a parameter reassigned in
the helper, a test reading another value) stays undecided: both branches, as before.
"""

from __future__ import annotations

import ast
import operator

from ..source.units import Func

_MISSING = object()
_CMP = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
        ast.Gt: operator.gt, ast.GtE: operator.ge, ast.Is: operator.is_, ast.IsNot: operator.is_not,
        ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b}
_LITERALS = (int, float, str, bool, type(None))


def _literal(node: ast.AST, consts: dict):
    """The value of a literal (or of a parameter bound to one), else _MISSING."""
    if isinstance(node, ast.Constant) and isinstance(node.value, _LITERALS):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        v = _literal(node.operand, consts)
        return -v if isinstance(v, (int, float)) and not isinstance(v, bool) else _MISSING
    if isinstance(node, ast.Name):
        return consts.get(node.id, _MISSING)
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        vals = [_literal(e, consts) for e in node.elts]
        if any(v is _MISSING for v in vals):
            return _MISSING
        return frozenset(vals) if isinstance(node, ast.Set) else tuple(vals)
    return _MISSING


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
        left = _literal(test.left, consts)
        if left is _MISSING:
            return None
        for op, right_node in zip(test.ops, test.comparators):
            right = _literal(right_node, consts)
            fn = _CMP.get(type(op))
            if right is _MISSING or fn is None:
                return None
            try:
                ok = fn(left, right)
            except TypeError:
                return None
            if not ok:
                return False
            left = right
        return True
    v = _literal(test, consts)
    return None if v is _MISSING else bool(v)


def _assigned(func: Func) -> set[str]:
    """Names the function (re)binds: such a parameter's value is not the call's constant."""
    got = func.__dict__.get("_assigned_names")
    if got is None:
        got = set()
        for n in func.scope:
            if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)):
                got.add(n.id)
            elif isinstance(n, (ast.Global, ast.Nonlocal)):
                got.update(n.names)
        func.__dict__["_assigned_names"] = got
    return got


def bound(call: ast.Call, callee: Func, bound_self: bool, outer: dict) -> dict:
    """{parameter: literal value} for ``call`` into ``callee``: literal arguments, arguments that
    are parameters of the caller bound to literals (``outer``), and literal defaults not given."""
    node = callee.node
    if isinstance(node, ast.Module) or any(isinstance(a, ast.Starred) for a in call.args) or \
            any(kw.arg is None for kw in call.keywords):
        return {}
    a = node.args
    positional = [p.arg for p in getattr(a, "posonlyargs", [])] + [p.arg for p in a.args]
    if bound_self and positional:
        positional = positional[1:]
    out: dict = {}
    given: set[str] = set()
    for name, arg in zip(positional, call.args):
        given.add(name)
        v = _literal(arg, outer)
        if v is not _MISSING:
            out[name] = v
    for kw in call.keywords:
        given.add(kw.arg)
        v = _literal(kw.value, outer)
        if v is not _MISSING:
            out[kw.arg] = v
    defaults = list(zip([p.arg for p in a.args][len(a.args) - len(a.defaults):], a.defaults))
    defaults += [(p.arg, d) for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
    for name, d in defaults:
        if name not in given:
            v = _literal(d, {})
            if v is not _MISSING:
                out[name] = v
    if out:
        rebound = _assigned(callee)
        out = {k: v for k, v in out.items() if k not in rebound}
    return out
