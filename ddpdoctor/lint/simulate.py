"""Concrete ranks: a second opinion for the structural rule when conditions are correlated.

When every rank-dependent condition of a function compares the rank with constants
(``if local_rank not in [-1, 0]: barrier()`` ... ``if local_rank == 0: barrier()``, the "first
rank prepares, the others wait" idiom), the function's communication sequence is computed for
ranks 0, 1, 2 and 3 and compared: equal sequences mean the ranks agree, whatever each single
``if`` looks like. Anything it cannot evaluate (a condition on a loss, a rank-dependent loop, an
exit out of a loop) makes it give up, and the structural rule's finding stands.
"""

from __future__ import annotations

import ast
import operator

from ..source.flow import EXIT_CALLS
from ..source.names import dotted, outer_ifexps
from ..source.program import Program
from ..source.taint import RANK_FUNCS, RANK_PARAMS, env_key
from ..source.units import Func
from .comm import CommModel, keys

RANKS = (0, 1, 2, 3)
INT_NAMES = frozenset({"rank", "local_rank", "global_rank", "process_index", "local_process_index", "rank_id",
                       "world_rank", "proc_rank"})
BOOL_NAMES = frozenset({"is_main_process", "is_local_main_process", "is_global_zero", "is_master", "is_main",
                        "is_rank_zero", "is_local_zero"})
WORLD_NAMES = frozenset({"world_size", "world", "num_processes", "nprocs", "ws"})
P2P_SEND = {"send": 1, "isend": 1, "send_object_list": 1}
P2P_RECV = {"recv": 1, "irecv": 1, "recv_object_list": 1}
#: World sizes tried for point-to-point matching: a mismatch is reported only when it shows in all.
WORLDS = (2, 3, 4, 5, 6, 7, 8)
_CMP = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
        ast.Gt: operator.gt, ast.GtE: operator.ge, ast.Is: operator.is_, ast.IsNot: operator.is_not,
        ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b}
_BIN = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Mod: operator.mod,
        ast.FloorDiv: operator.floordiv}


class Undecidable(Exception):
    pass


class Simulator:
    def __init__(self, prog: Program, cm: CommModel) -> None:
        self.prog = prog
        self.cm = cm
        self._agree: dict[int, bool | None] = {}
        #: the world size while point-to-point traffic is simulated (None: unknown)
        self.world: int | None = None

    def ranks_agree(self, func: Func) -> bool | None:
        """True when ranks 0-3 issue the same communication through ``func``; False when they
        do not; None when some condition cannot be evaluated."""
        if id(func) in self._agree:
            return self._agree[id(func)]
        try:
            seqs = {tuple(self.block(func.body, func, r)[0]) for r in self.ranks(func)}
            out = len(seqs) == 1
        except (Undecidable, RecursionError, TypeError, ValueError, ZeroDivisionError):
            out = None
        self._agree[id(func)] = out
        return out

    def ranks(self, func: Func) -> list[int]:
        """Ranks 0-3 plus both sides of every integer constant the function's conditions use
        (``rank < 8`` is decided by ranks 7 and 8)."""
        out = set(RANKS)
        for n in func.scope:
            if isinstance(n, (ast.If, ast.While)) and self.prog.test_taint(func, n):
                for c in ast.walk(n.test):
                    if isinstance(c, ast.Constant) and type(c.value) is int and 0 <= c.value <= 1_000_000:
                        out.update((max(0, c.value - 1), c.value, c.value + 1))
        return sorted(out)

    def bindings(self, func: Func) -> dict[str, int]:
        """How many places bind each name/attribute in the function (assignments, augmented
        assignments, loop and ``with`` targets, ``:=``)."""
        got = func.__dict__.get("_bindings")
        if got is not None:
            return got
        counts: dict[str, int] = {}

        def add(t):
            if isinstance(t, (ast.Tuple, ast.List)):
                for x in t.elts:
                    add(x)
            elif isinstance(t, ast.Starred):
                add(t.value)
            else:
                k = dotted(t)
                if k:
                    counts[k] = counts.get(k, 0) + 1

        for n in func.scope:
            if isinstance(n, ast.Assign):
                for t in n.targets:
                    add(t)
            elif isinstance(n, (ast.AugAssign, ast.AnnAssign, ast.For, ast.AsyncFor, ast.NamedExpr)):
                add(n.target)
            elif isinstance(n, (ast.With, ast.AsyncWith)):
                for it in n.items:
                    if it.optional_vars is not None:
                        add(it.optional_vars)
        func.__dict__["_bindings"] = counts
        return counts

    # -- statements ------------------------------------------------------------------------------
    def block(self, stmts: list[ast.stmt], func: Func, r: int) -> tuple[list, str | None]:
        out: list = []
        for s in stmts:
            ev, ex = self.stmt(s, func, r)
            out.extend(ev)
            if ex:
                return out, ex
        return out, None

    def stmt(self, s: ast.stmt, func: Func, r: int) -> tuple[list, str | None]:
        cm = self.cm
        if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return [], None
        if isinstance(s, ast.If):
            head = [k for k, _c in cm.expr_events(s.test, func)]
            if self.prog.test_taint(func, s):
                chosen = s.body if self.value(s.test, func, r, 0) else s.orelse
                ev, ex = self.block(chosen, func, r)
                return head + ev, ex
            a, xa = self.block(s.body, func, r)
            b, xb = self.block(s.orelse, func, r)
            if xa or xb:
                if xa == xb and a == b:
                    return head + a, xa
                raise Undecidable
            return head + (a if a == b else [("choice", tuple(a), tuple(b))]), None
        if isinstance(s, (ast.For, ast.AsyncFor, ast.While)):
            if self.prog.test_taint(func, s):
                raise Undecidable
            head = [k for k, _c in cm.expr_events(s.iter if not isinstance(s, ast.While) else s.test, func)]
            body, ex = self.block(s.body, func, r)
            if ex:
                raise Undecidable
            return head + ([("loop", tuple(body))] if body else []), None
        if isinstance(s, (ast.With, ast.AsyncWith)):
            head = [k for it in s.items for k, _c in cm.expr_events(it.context_expr, func)]
            ev, ex = self.block(s.body, func, r)
            return head + ev, ex
        if isinstance(s, ast.Try):
            ev, ex = self.block(s.body, func, r)
            fin, ex2 = self.block(s.finalbody, func, r)
            return ev + fin, ex or ex2
        if isinstance(s, (ast.Break, ast.Continue)):
            return [], "loop"
        ev = [k for k, _c in cm.stmt(s, func)]
        if any(isinstance(k, tuple) and k and k[0] == "choice" for k in ev):
            ev = self._ifexp_choices(s, func, r, ev)
        if isinstance(s, ast.Return):
            return ev, "return"
        if isinstance(s, ast.Raise):
            return ev, "raise"
        if isinstance(s, ast.Expr) and isinstance(s.value, ast.Call) and dotted(s.value.func) in EXIT_CALLS:
            return ev, "exit"
        return ev, None

    def _ifexp_choices(self, s: ast.stmt, func: Func, r: int, ev: list) -> list:
        """A statement's events with each rank-dependent conditional expression's choice
        (``all_reduce(t) if rank == 0 else None``) replaced by the side rank ``r`` takes."""
        for x in outer_ifexps(s):
            if not self.prog.test_taint(func, x):
                continue
            a, b = keys(self.cm.expr_events(x.body, func)), keys(self.cm.expr_events(x.orelse, func))
            if a == b or ("choice", a, b) not in ev:
                continue
            i = ev.index(("choice", a, b))
            ev = ev[:i] + list(a if self.value(x.test, func, r, 0) else b) + ev[i + 1:]
        return ev

    # -- values --------------------------------------------------------------------------------
    def value(self, e: ast.AST, func: Func, r: int, depth: int):
        if depth > 8:
            raise Undecidable
        if isinstance(e, ast.Constant):
            return e.value
        if isinstance(e, (ast.List, ast.Tuple, ast.Set)):
            return [self.value(x, func, r, depth + 1) for x in e.elts]
        if isinstance(e, ast.Compare):
            left = self.value(e.left, func, r, depth + 1)
            for op, right_node in zip(e.ops, e.comparators):
                right = self.value(right_node, func, r, depth + 1)
                if not _CMP[type(op)](left, right):
                    return False
                left = right
            return True
        if isinstance(e, ast.BoolOp):
            vals = (self.value(v, func, r, depth + 1) for v in e.values)
            return all(vals) if isinstance(e.op, ast.And) else any(vals)
        if isinstance(e, ast.UnaryOp):
            v = self.value(e.operand, func, r, depth + 1)
            if isinstance(e.op, ast.Not):
                return not v
            if isinstance(e.op, ast.USub):
                return -v
            raise Undecidable
        if isinstance(e, ast.BinOp) and type(e.op) in _BIN:
            return _BIN[type(e.op)](self.value(e.left, func, r, depth + 1), self.value(e.right, func, r, depth + 1))
        if isinstance(e, ast.Call):
            k = env_key(e)
            if k is not None:
                if k in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "SLURM_LOCALID"):
                    return str(r)
                if k == "WORLD_SIZE" and self.world is not None:
                    return str(self.world)
                raise Undecidable
            canon = (func.module.imports.canonical(e.func) or "").replace(".distributed_c10d.", ".")
            if canon in RANK_FUNCS and canon.rsplit(".", 1)[-1] in ("get_rank", "get_local_rank",
                                                                    "get_node_local_rank", "get_ordinal"):
                return r
            if self.world is not None and canon == "torch.distributed.get_world_size" and not e.args:
                return self.world
            if dotted(e.func) == "range" and 1 <= len(e.args) <= 3:
                return range(*[self.value(a, func, r, depth + 1) for a in e.args])
            if dotted(e.func) == "len" and len(e.args) == 1:
                return len(self.value(e.args[0], func, r, depth + 1))
            if dotted(e.func) in ("int", "str") and len(e.args) == 1:
                v = self.value(e.args[0], func, r, depth + 1)
                return int(v) if dotted(e.func) == "int" else str(v)
            raise Undecidable
        if isinstance(e, ast.Subscript):
            k = env_key(e)
            if k in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "SLURM_LOCALID"):
                return str(r)
            if k == "WORLD_SIZE" and self.world is not None:
                return str(self.world)
            raise Undecidable
        key = dotted(e)
        if key is None:
            raise Undecidable
        value = self.prog.last_assignment(func, key, getattr(e, "lineno", 10 ** 9))
        if value is not None:
            owner = self.prog.func_at(func.module, value.lineno)
            if self.bindings(owner).get(key, 0) != 1:
                raise Undecidable  # reassigned, augmented or a loop variable: not one value
            return self.value(value, owner, r, depth + 1)
        if self.bindings(func).get(key, 0):
            raise Undecidable  # bound here, but not by a plain assignment (a loop variable `rank`)
        last = key.rsplit(".", 1)[-1]
        if last in INT_NAMES or (key in func.params and key in RANK_PARAMS):
            return r
        if self.world is not None and last in WORLD_NAMES:
            return self.world
        if last in BOOL_NAMES:
            return r == 0
        if key in func.params and func.param_taint[func.params.index(key)]:
            if any("passes" in reason for reason in func.param_taint[func.params.index(key)]):
                return r  # the rank mp.spawn passes
        raise Undecidable


    # -- point-to-point traffic ------------------------------------------------------------------
    def p2p_mismatch(self, func: Func) -> dict | None:
        """The first unmatched point-to-point traffic when it is unmatched for every world size
        tried (2-8); None when it matches for some size, or cannot be computed."""
        first = None
        for w in WORLDS:
            self.world = w
            try:
                per_rank = {r: self.p2p_block(func.body, func, r) for r in range(w)}
            except (Undecidable, RecursionError, TypeError, ValueError, ZeroDivisionError):
                return None
            finally:
                self.world = None
            bad = _unmatched(per_rank, w)
            if bad is None:
                return None
            if first is None:
                first = bad
        return first

    def p2p_block(self, stmts, func: Func, r: int) -> dict:
        """{(kind, peer): [count, first line]} for rank r through these statements."""
        out: dict = {}
        for s in stmts:
            if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if isinstance(s, (ast.Return, ast.Raise, ast.Break, ast.Continue)):
                if self._p2p_calls(s, func):
                    raise Undecidable
                return out  # what follows is not reached on this path
            if isinstance(s, ast.If):
                if self.prog.test_taint(func, s):
                    sub = self.p2p_block(s.body if self.value(s.test, func, r, 0) else s.orelse, func, r)
                else:
                    a, b = self.p2p_block(s.body, func, r), self.p2p_block(s.orelse, func, r)
                    if a != b:
                        raise Undecidable
                    sub = a
                _merge(out, sub, 1)
                continue
            if isinstance(s, (ast.For, ast.AsyncFor)):
                sub = self.p2p_block(s.body, func, r)
                if sub:
                    if not (isinstance(s.iter, ast.Call) and dotted(s.iter.func) == "range"):
                        raise Undecidable
                    _merge(out, sub, len(self.value(s.iter, func, r, 0)))
                continue
            if isinstance(s, ast.While):
                if self.p2p_block(s.body, func, r):
                    raise Undecidable
                continue
            if isinstance(s, (ast.With, ast.AsyncWith, ast.Try)):
                _merge(out, self.p2p_block(s.body, func, r), 1)
                continue
            for call, kind in self._p2p_calls(s, func):
                peer_node = next((k.value for k in call.keywords if k.arg in ("dst", "src")), None)
                if peer_node is None and len(call.args) > 1:
                    peer_node = call.args[1]
                if peer_node is None or any(k.arg == "group" for k in call.keywords):
                    raise Undecidable
                peer = self.value(peer_node, func, r, 0)
                if not isinstance(peer, int):
                    raise Undecidable
                _merge(out, {(kind, peer): [1, call.lineno]}, 1)
        return out

    def _p2p_calls(self, s: ast.stmt, func: Func) -> list:
        out = []
        for call in self.cm.calls_in(s, func):
            canon = (func.module.imports.canonical(call.func) or "").replace(".distributed_c10d.", ".")
            last = canon.rsplit(".", 1)[-1]
            if canon.startswith("torch.distributed.") and (last in P2P_SEND or last in P2P_RECV):
                out.append((call, "send" if last in P2P_SEND else "recv"))
            elif canon.startswith("torch.distributed.") and last == "batch_isend_irecv":
                raise Undecidable
        return out


def _merge(out: dict, sub: dict, times: int) -> None:
    for k, (n, line) in sub.items():
        if k in out:
            out[k][0] += n * times
        else:
            out[k] = [n * times, line]


def _unmatched(per_rank: dict, w: int) -> dict | None:
    """The first (sender, receiver) pair whose message counts differ, or None."""
    for a in range(w):
        for (kind, peer), (n, line) in sorted(per_rank[a].items(), key=lambda kv: kv[1][1]):
            if not 0 <= peer < w or peer == a:
                return {"rank": a, "kind": kind, "peer": peer, "count": n, "line": line, "other": 0,
                        "other_line": None, "world": w}
            back = "recv" if kind == "send" else "send"
            m, oline = per_rank[peer].get((back, a), [0, None])
            if m != n:
                return {"rank": a, "kind": kind, "peer": peer, "count": n, "line": line, "other": m,
                        "other_line": oline, "world": w}
    return None
