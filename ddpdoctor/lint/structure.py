"""The structural rule: communication reached under a rank-dependent condition.

For every ``if`` whose test depends on the rank, the communication sequence of the ranks where it
holds is compared with that of the others: each branch, followed by what comes after the ``if``
unless the branch leaves first (``return``/``raise``/``sys.exit`` leave the function,
``break``/``continue`` the loop: the rest of the loop body, and for ``break`` its next
iterations, are skipped). Different sequences are a finding naming the communication, the
condition and what the other ranks do instead. A loop whose trip count depends on the rank
(``for x in data[rank::world]``, ``while`` on a rank-dependent test) with communication in its body
is the same bug (DD006 when that communication is a DDP step), unless it runs inside ``Join``.
A ``raise`` under a rank-dependent condition in a function whose callers communicate afterwards
is DD008 (one rank fails, the others wait). Point-to-point calls and collectives on an explicit
subgroup are left out of the comparison (ranks legitimately differ there).
"""

from __future__ import annotations

import ast

from ..analysis.findings import Finding
from ..source.flow import block_exit, stmt_exit
from ..source.names import dotted, outer_ifexps
from ..source.program import Program
from ..source.taint import describe, is_heuristic
from ..source.units import Func
from .comm import Comm, CommModel, keys
from .finding import loc, make
from .simulate import Simulator

DDP_OPS = ("ddp-forward", "ddp-backward", "fsdp-forward")
GROUP_OPS = ("new_group", "new_subgroups", "new_subgroups_by_enumeration", "init_process_group", "init_device_mesh")
_LOOPS = (ast.For, ast.AsyncFor, ast.While)


def _name(c: Comm) -> str:
    return c.what


def _first(events: list[tuple]) -> Comm:
    c = events[0][1]
    return c


class Structure:
    def __init__(self, prog: Program, cm: CommModel) -> None:
        self.prog = prog
        self.cm = cm
        self.out: list[Finding] = []
        self._raises: dict[int, list] = {}
        self.sim = Simulator(prog, cm)

    # -- walking -----------------------------------------------------------------------------------
    def run(self) -> list[Finding]:
        for f in self.prog.funcs:
            if id(f) in self.prog.skipped:
                continue
            try:
                self.visit(f, f.body, [])
            except RecursionError:
                self.prog.skip(f)
        return self.out

    def visit(self, func: Func, stmts: list[ast.stmt], stack: list) -> None:
        for i, s in enumerate(stmts):
            if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            here = stack + [(stmts, i, s)]
            if isinstance(s, ast.If):
                self.check_if(func, s, stack + [(stmts, i, None)])
            elif isinstance(s, _LOOPS):
                self.check_loop(func, s, stack)
            elif isinstance(s, _SIMPLE):
                self.check_ifexps(func, s, stack + [(stmts, i, None)])
            self.check_calls_that_raise(func, s, stack + [(stmts, i, None)])
            for field in ("body", "orelse", "finalbody"):
                sub = getattr(s, field, None)
                if isinstance(sub, list) and sub and isinstance(sub[0], ast.stmt):
                    self.visit(func, sub, here[:-1] + [(stmts, i, (s, field))])
            for h in getattr(s, "handlers", []) or []:
                self.visit(func, h.body, stack + [(stmts, i, (s, "handler"))])
            for case in getattr(s, "cases", []) or []:
                self.visit(func, case.body, stack + [(stmts, i, (s, "case"))])

    def rest(self, func: Func, stack: list, how: str) -> list[tuple] | None:
        """Communication skipped by leaving (``how``) at the innermost position of ``stack``;
        None when a ``raise`` is caught by an enclosing ``try`` of this function."""
        out: list[tuple] = []
        for stmts, i, owner in reversed(stack):
            # owner: the statement whose block we are leaving (None: the innermost position)
            if owner is not None:
                node, field = owner
                if isinstance(node, _LOOPS) and field == "body":
                    if how == "continue":
                        return out
                    again = self.cm.block(node.body, func)
                    if again:
                        out.append((("loop", keys(again)), _first(again)))
                    if how == "break":
                        return out
                if isinstance(node, ast.Try) and field == "body" and node.handlers and how == "raise":
                    return None
            out.extend(self.cm.block(stmts[i + 1:], func))
        return out

    # -- if ----------------------------------------------------------------------------------------
    def check_if(self, func: Func, s: ast.If, stack: list) -> None:
        t = self.prog.test_taint(func, s)
        if not t:
            return
        a, b = self.cm.block(s.body, func), self.cm.block(s.orelse, func)
        xa, xb = block_exit(s.body), block_exit(s.orelse)
        ra = rb = None
        if xa and not xb:
            rb = self.rest(func, stack, xa)
        elif xb and not xa:
            ra = self.rest(func, stack, xb)
        full_a = a + (ra or [])
        full_b = b + (rb or [])
        if keys(full_a) == keys(full_b):
            return
        n, ca, cb = _first_difference(full_a, full_b)
        in_a = ca is not None and n < len(a)
        in_b = cb is not None and n < len(b)
        cond_text = _header(s)
        reason = describe(t)
        sure_cond = not is_heuristic(t)
        cond_loc = loc(func.module, s.lineno, "condition", func.name)
        if in_a or in_b:
            # a communication inside a branch that the other side does not issue there
            c, side, other, other_in = (ca, "true", cb, in_b) if in_a else (cb, "false", ca, in_a)
            exit_kind = xb if side == "true" else xa
            if other is not None:
                instead = f"issue {_what(other)} instead"
            elif exit_kind:
                instead = f"{_exit_words(exit_kind)} without it"
            else:
                after = self.rest(func, stack, "return") or []
                instead = (f"go on without it, to {_what(after[0][1])}" if after else "go on without it")
            check_id = "DD012" if c.op in GROUP_OPS else "DD001"
            sev = "error" if (sure_cond and c.sure) else "warning"
            if other is None and exit_kind == "raise":
                # the other side is an error path (`else: raise ValueError("unknown rank")`):
                # the ranks that take it fail, which is DD008's business, and may never exist
                check_id, sev = "DD008", "warning"
            msg = (f"{_what(c)} runs only on ranks where `{cond_text}` (line "
                   f"{s.lineno}) is {side}; it depends on the rank through {reason}. The other ranks "
                   f"{instead}: the ranks disagree on the next collective and wait for each other.")
            if not c.sure:
                msg += " (Whether this call communicates depends on code not in view.)"
            locs = [loc(func.module, c.line, "call", func.name), cond_loc]
            if other is not None:
                locs.append(loc(func.module, other.line, "call", func.name))
            self.emit(make(check_id, sev, msg, locs, fix=_FIX_BRANCH,
                           data={"condition_line": s.lineno, "call_line": c.line, "op": c.op}), func)
            return
        # the communication differs only after one side left early
        c = ca or cb
        side_left = "false" if ca is not None else "true"
        exit_kind = xa if side_left == "true" else xb
        exit_node = _exit_stmt(s.body if side_left == "true" else s.orelse)
        exit_line = exit_node.lineno if exit_node is not None else s.lineno
        if exit_kind in ("raise",):
            check_id, sev = "DD008", "warning"
        elif exit_kind == "exit":
            check_id, sev = "DD008", "error" if (sure_cond and c.sure) else "warning"
        else:
            check_id, sev = "DD001", "error" if (sure_cond and c.sure) else "warning"
        msg = (f"Ranks where `{cond_text}` (line {s.lineno}) is {side_left} {_exit_words(exit_kind)} at line "
               f"{exit_line} and skip {_what(c)} which the other ranks issue; "
               f"the condition depends on the rank through {reason}.")
        locs = [cond_loc, loc(func.module, exit_line, "exit", func.name), loc(func.module, c.line, "call", func.name)]
        self.emit(make(check_id, sev, msg, locs, fix=_FIX_EXIT,
                       data={"condition_line": s.lineno, "call_line": c.line, "exit_line": exit_line,
                             "op": c.op}), func)

    def check_ifexps(self, func: Func, s: ast.stmt, stack: list) -> None:
        """``x = dist.all_reduce(t) if rank == 0 else None``: a conditional expression whose sides
        communicate differently under a rank-dependent test, as check_if does for statements."""
        for x in outer_ifexps(s):
            t = self.prog.test_taint(func, x)
            if not t:
                continue
            a, b = self.cm.expr_events(x.body, func), self.cm.expr_events(x.orelse, func)
            if keys(a) == keys(b):
                continue
            _n, ca, cb = _first_difference(a, b)
            c, side, other = (ca, "true", cb) if ca is not None else (cb, "false", ca)
            if other is not None:
                instead = f"issue {_what(other)} instead"
            else:
                after = self.rest(func, stack, "return") or []
                instead = f"go on without it, to {_what(after[0][1])}" if after else "go on without it"
            try:
                cond_text = ast.unparse(x.test)
            except Exception:  # pragma: no cover
                cond_text = "..."
            msg = (f"{_what(c)} runs only on ranks where `{cond_text}` (line {x.lineno}, a conditional "
                   f"expression) is {side}; it depends on the rank through {describe(t)}. The other ranks "
                   f"{instead}: the ranks disagree on the next collective and wait for each other.")
            if not c.sure:
                msg += " (Whether this call communicates depends on code not in view.)"
            locs = [loc(func.module, c.line, "call", func.name), loc(func.module, x.lineno, "condition", func.name)]
            if other is not None:
                locs.append(loc(func.module, other.line, "call", func.name))
            sev = "error" if (not is_heuristic(t) and c.sure) else "warning"
            self.emit(make("DD012" if c.op in GROUP_OPS else "DD001", sev, msg, locs, fix=_FIX_BRANCH,
                           data={"condition_line": x.lineno, "call_line": c.line, "op": c.op}), func)

    # -- loops -------------------------------------------------------------------------------------
    def check_loop(self, func: Func, s: ast.stmt, stack: list) -> None:
        t = self.prog.test_taint(func, s)
        if not t:
            return
        body = self.cm.block(s.body, func)
        if not body or _in_join(stack, func):
            return
        c = body[0][1]
        ddp = any(isinstance(k, str) and k in DDP_OPS for k in _flat(keys(body)))
        counted = isinstance(s, ast.While) or (
            isinstance(s.iter, ast.Call) and dotted(s.iter.func) in ("range",))
        sure = counted and not is_heuristic(t) and c.sure
        check_id = "DD006" if ddp else "DD001"
        what = "test" if isinstance(s, ast.While) else "iterable"
        msg = (f"The number of iterations of `{_header(s)}` (line {s.lineno}) depends on the "
               f"rank through {describe(t)} (its {what}), and every iteration communicates ({_what(c)}): a "
               f"rank with more iterations waits for the others"
               + ("." if sure else ", unless the lengths happen to be equal."))
        fix = _FIX_UNEVEN if ddp else _FIX_BRANCH
        self.emit(make(check_id, "error" if sure else "warning", msg,
                       [loc(func.module, s.lineno, "condition", func.name), loc(func.module, c.line, "call", func.name)],
                       fix=fix, data={"condition_line": s.lineno, "call_line": c.line, "op": c.op}))

    # -- raise in a callee -------------------------------------------------------------------------
    def rank_raises(self, func: Func) -> list:
        """(raise line, condition line, reason) of raises under rank-dependent ifs of ``func``
        that no ``try`` of ``func`` catches."""
        got = self._raises.get(id(func))
        if got is not None:
            return got
        out: list = []

        def walk(stmts, cond, caught):
            for s in stmts:
                if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    continue
                if isinstance(s, ast.Raise) and cond is not None and not caught:
                    out.append((s.lineno, cond[0], cond[1]))
                if isinstance(s, ast.If):
                    t = self.prog.test_taint(func, s)
                    c = (s.lineno, describe(t), not is_heuristic(t)) if t else cond
                    walk(s.body, c, caught)
                    walk(s.orelse, c, caught)
                elif isinstance(s, ast.Try):
                    walk(s.body, cond, caught or bool(s.handlers))
                    for h in s.handlers:
                        walk(h.body, cond, caught)
                    walk(s.orelse, cond, caught)
                    walk(s.finalbody, cond, caught)
                else:
                    for field in ("body", "orelse"):
                        sub = getattr(s, field, None)
                        if isinstance(sub, list) and sub and isinstance(sub[0], ast.stmt):
                            walk(sub, cond, caught)

        walk(func.body, None, False)
        self._raises[id(func)] = out
        return out

    def check_calls_that_raise(self, func: Func, s: ast.stmt, stack: list) -> None:
        if isinstance(s, (ast.If, ast.For, ast.AsyncFor, ast.While, ast.Try, ast.With, ast.AsyncWith)):
            heads = [getattr(s, "test", None), getattr(s, "iter", None)] + \
                [it.context_expr for it in getattr(s, "items", [])]
            nodes = [h for h in heads if h is not None]
        else:
            nodes = [s]
        for node in nodes:
            for call in self.cm.calls_in(node, func):
                callee, _b = self.prog.resolve(call, func)
                if callee is None or callee is func:
                    continue
                for raise_line, cond_line, reason in self.rank_raises(callee):
                    skipped = self.rest(func, stack, "raise")
                    if not skipped:
                        continue
                    c = skipped[0][1]
                    m = callee.module
                    msg = (f"{callee.name}() raises at line {raise_line} under `{_strip_comment(m.line(cond_line))}` "
                           f"(line {cond_line}), which depends on the rank through {reason}; called at "
                           f"{func.module.display}:{call.lineno}, the failing rank then skips {_what(c)} "
                           f"where the other ranks wait until the backend's "
                           f"timeout instead of failing.")
                    self.emit(make("DD008", "warning", msg,
                                   [loc(m, raise_line, "exception", callee.name), loc(m, cond_line, "condition", callee.name),
                                    loc(func.module, call.lineno, "call", func.name),
                                    loc(func.module, c.line, "call", func.name)],
                                   fix=_FIX_RAISE, data={"condition_line": cond_line, "call_line": c.line,
                                                         "exit_line": raise_line, "op": c.op}))

    def emit(self, f: Finding, func: Func | None = None) -> None:
        if func is not None and f.id in ("DD001", "DD012") and self.sim.ranks_agree(func):
            return  # ranks 0-3, simulated, issue the same communication: correlated conditions
        self.out.append(f)


#: Statements without blocks (their conditional expressions are checked like `if`s).
_SIMPLE = (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.Expr, ast.Return)


def _first_difference(a: list[tuple], b: list[tuple]) -> tuple[int, Comm | None, Comm | None]:
    """Where two event sequences first differ: (index, a's event there, b's event there)."""
    n = 0
    while n < min(len(a), len(b)) and a[n][0] == b[n][0]:
        n += 1
    return n, (a[n][1] if n < len(a) else None), (b[n][1] if n < len(b) else None)


def _header(s: ast.stmt) -> str:
    """``if <test>:`` / ``for <target> in <iter>:`` / ``while <test>:``, without comments."""
    try:
        if isinstance(s, ast.If):
            return f"if {ast.unparse(s.test)}:"
        if isinstance(s, ast.While):
            return f"while {ast.unparse(s.test)}:"
        if isinstance(s, (ast.For, ast.AsyncFor)):
            return f"for {ast.unparse(s.target)} in {ast.unparse(s.iter)}:"
    except Exception:  # pragma: no cover
        pass
    return ""


def _strip_comment(line: str) -> str:
    return line.split("  #", 1)[0].rstrip()


def _flat(k):
    if isinstance(k, tuple):
        for x in k:
            yield from _flat(x)
    else:
        yield k


def _what(c: Comm) -> str:
    """The communication as the user sees it at this line: the call itself, or the user function
    call that reaches it."""
    if not c.via:
        return f"{c.what} at line {c.line}"
    _name, line, display = c.via[-1]
    chain = " -> ".join(f"{n}()" for n, _l, _d in c.via)
    return f"`{c.via[0][0]}()` at line {c.line}, which reaches {c.what} at {display}:{line} (through {chain}),"


def _exit_words(kind: str | None) -> str:
    return {"return": "return", "raise": "raise", "break": "leave the loop", "continue": "skip to the next iteration",
            "exit": "exit the process"}.get(kind or "", "leave")


def _exit_stmt(stmts: list[ast.stmt]) -> ast.stmt | None:
    for s in stmts:
        if isinstance(s, (ast.Return, ast.Raise, ast.Break, ast.Continue)):
            return s
        if isinstance(s, ast.Expr) and isinstance(s.value, ast.Call):
            if stmt_exit(s):
                return s
        if isinstance(s, ast.If):
            if stmt_exit(s):
                return _exit_stmt(s.body) or s
    return None


def _in_join(stack: list, func: Func) -> bool:
    for _stmts, _i, owner in stack:
        if owner is None:
            continue
        node, _f = owner
        if isinstance(node, (ast.With, ast.AsyncWith)):
            for it in node.items:
                e = it.context_expr
                name = dotted(e.func) if isinstance(e, ast.Call) else dotted(e)
                if name and (name.rsplit(".", 1)[-1] in ("Join", "join")):
                    return True
    return False


_FIX_BRANCH = ("Make every rank issue the same collectives in the same order: move the collective out of the "
               "rank-dependent branch (compute on all ranks, use the result on one), or give the other ranks "
               "the matching call.")
_FIX_EXIT = ("Decide together: all_reduce the local verdict (e.g. with ReduceOp.MAX) and branch on the result, "
             "so that every rank leaves at the same point.")
_FIX_UNEVEN = ("Give every rank the same number of steps (DistributedSampler, drop_last, or pad), or wrap the "
               "loop in `with Join([model]):`.")
_FIX_RAISE = ("Catch the error on the failing rank and agree on it (all_reduce a flag, then skip or stop on "
              "every rank), or make the job fail fast (a process-group timeout, torchrun's failure handling).")
