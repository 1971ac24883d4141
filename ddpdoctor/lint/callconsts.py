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

from ..source.consts import MISSING, literal
from ..source.units import Func


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
        v = literal(arg, outer)
        if v is not MISSING:
            out[name] = v
    for kw in call.keywords:
        given.add(kw.arg)
        v = literal(kw.value, outer)
        if v is not MISSING:
            out[kw.arg] = v
    defaults = list(zip([p.arg for p in a.args][len(a.args) - len(a.defaults):], a.defaults))
    defaults += [(p.arg, d) for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
    for name, d in defaults:
        if name not in given:
            v = literal(d, {})
            if v is not MISSING:
                out[name] = v
    if out:
        rebound = _assigned(callee)
        out = {k: v for k, v in out.items() if k not in rebound}
    return out
