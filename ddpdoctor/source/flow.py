"""The flow part of the rank-dependence analysis: one walk over a function (or a module's
top-level code) in statement order, keeping the taint of every local name and attribute.

Branches are walked separately and merged (a value assigned under a rank-dependent condition is
rank-dependent); loop bodies are walked twice so that a value carried from one iteration to the
next is seen; an in-place collective of the whole world (``dist.all_reduce(x)``) makes its
tensor the same everywhere again. The walk records the taint of every condition, every ``for``
iterable and every name/attribute read, which the rules read afterwards.
"""

from __future__ import annotations

import ast
from typing import Protocol

from .consts import decide
from .names import dotted, outer_ifexps
from .shards import items
from .taint import CLEAN, PASS_THROUGH, UNIFORMING, Evaluator, presence_test, strip_data, substitute
from .units import Func

EXIT_CALLS = frozenset({"sys.exit", "exit", "quit", "os._exit", "os.abort"})


def stmt_exit(s: ast.stmt) -> str | None:
    """How a statement leaves its block unconditionally: return/raise/break/continue/exit."""
    if isinstance(s, ast.Return):
        return "return"
    if isinstance(s, ast.Raise):
        return "raise"
    if isinstance(s, ast.Break):
        return "break"
    if isinstance(s, ast.Continue):
        return "continue"
    if isinstance(s, ast.Expr) and isinstance(s.value, ast.Call) and dotted(s.value.func) in EXIT_CALLS:
        return "exit"
    if isinstance(s, ast.If) and s.orelse:
        a, b = block_exit(s.body), block_exit(s.orelse)
        if a and b:
            return a if a == b else "return"
    return None


def block_exit(stmts: list[ast.stmt]) -> str | None:
    for s in stmts:
        e = stmt_exit(s)
        if e:
            return e
    return None


def _assigned_names(target: ast.AST, out: list[str]) -> None:
    if isinstance(target, (ast.Tuple, ast.List)):
        for e in target.elts:
            _assigned_names(e, out)
    elif isinstance(target, ast.Starred):
        _assigned_names(target.value, out)
    else:
        k = dotted(target)
        if k is not None:
            out.append(k)


def _distributed_side(test: ast.AST) -> bool | None:
    """For a test of whether the rank is set at all (``RANK != -1``, ``local_rank is None``): True
    when the ``if`` body is the distributed side, False when the else is, None for other tests."""
    if not (isinstance(test, ast.Compare) and presence_test(test)):
        return None
    names = {n.id for n in ast.walk(test) if isinstance(n, ast.Name)}
    if len(names) != 1:
        return None
    name = names.pop()
    for unset in (-1, None):
        a, b = decide(test, {name: unset}), decide(test, {name: 0})
        if a is not None and b is not None and a != b:
            return b
    return None


def _rewraps(s: ast.Assign) -> bool:
    """``x = tqdm(x, ...)``: a progress bar (or ``enumerate``) around the value itself."""
    v = s.value
    if len(s.targets) != 1 or not isinstance(v, ast.Call) or not v.args:
        return False
    last = (dotted(v.func) or "").rsplit(".", 1)[-1].lower()
    return last in PASS_THROUGH and dotted(v.args[0]) is not None and dotted(v.args[0]) == dotted(s.targets[0])


def _enumerates(node: ast.AST) -> bool:
    """``enumerate(x)``, also inside a progress bar: ``tqdm(enumerate(loader))``."""
    while isinstance(node, ast.Call) and node.args:
        f = dotted(node.func) or ""
        if f.rsplit(".", 1)[-1] == "enumerate":
            return True
        if f.rsplit(".", 1)[-1] not in ("tqdm", "track"):
            return False
        node = node.args[0]
    return False


#: Methods that put their arguments into the object they are called on.
MUTATORS = frozenset({"append", "extend", "insert", "add", "update", "appendleft", "put", "push", "setdefault"})
#: Methods named for a collective: the object is the same on every rank afterwards (the
#: AverageMeter of pytorch/examples' ImageNet script, DETR's and DeiT's MetricLogger).
SYNC_METHODS = frozenset({"all_reduce", "allreduce", "sync", "synchronize", "synchronize_between_processes",
                          "sync_dist", "reduce_from_all_processes"})


#: Statements without blocks, whose conditional expressions' tests are recorded.
_SIMPLE = (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.Expr, ast.Return)


class ProgramState(Protocol):
    """What a walk reads and updates in the whole program (``program.Program``, which drives the
    walks: declared here so that this module does not import the one that imports it)."""

    extra_names: frozenset
    module_env: dict[str, dict[str, frozenset]]

    def outer_taint(self, func: Func, key: str) -> frozenset | None: ...

    def resolve(self, call: ast.Call, func: Func) -> tuple[Func | None, bool]: ...

    def note_call(self, caller: Func, callee: Func, params: list[frozenset]) -> None: ...

    def set_class_attr(self, cls: ast.ClassDef, attr: str, t: frozenset) -> None: ...


class Walker:
    """Walks one function once; ``final`` makes it record what the rules read."""

    def __init__(self, prog: ProgramState, func: Func, final: bool) -> None:
        self.prog = prog
        self.func = func
        self.final = final
        self.facts = func.facts
        self.env: dict[str, frozenset] = {}
        for i, p in enumerate(func.params):
            self.env[p] = frozenset({f"@{i}"})
        self.returns = CLEAN
        self.displays: dict[str, frozenset] = {}  # list -> names and element dumps of its display
        self.last_value: dict[str, str] = {}  # name -> ast.dump of the value last assigned to it
        self.broadcast: dict[str, tuple] = {}  # list broadcast from a source rank -> (names, src)
        self.ev = Evaluator(func.module.imports, self._lookup, self._call_result, prog.extra_names)

    # -- lookups -----------------------------------------------------------------------------------
    def _lookup(self, node: ast.AST, key: str):
        t = self.env.get(key)
        if t is None:
            t = self.prog.outer_taint(self.func, key)
        if self.final and t is not None:
            self.facts.loads[id(node)] = t
        return t

    def _call_result(self, call: ast.Call, args: list, kws: dict):
        callee, bound = self.prog.resolve(call, self.func)
        if callee is None:
            return None
        params = ([CLEAN] if bound else []) + list(args)
        for name, t in kws.items():
            if name in callee.params:
                i = callee.params.index(name)
                while len(params) <= i:
                    params.append(CLEAN)
                params[i] = params[i] | t
        self.prog.note_call(self.func, callee, params)
        return substitute(callee.returns, params)

    # -- statements ------------------------------------------------------------------------------
    def run(self) -> None:
        body = self.func.body
        self.block(body, CLEAN)
        self.func.returns = self.returns
        if self.func.node is None or isinstance(self.func.node, ast.Module):
            self.prog.module_env[self.func.module.path] = dict(self.env)

    def block(self, stmts: list[ast.stmt], ctrl: frozenset) -> bool:
        """Walk statements; True when the block always leaves (its state does not flow on)."""
        for s in stmts:
            self.stmt(s, ctrl)
            if stmt_exit(s):
                return True
        return False

    def assign(self, key: str, t: frozenset, weak: bool = False) -> None:
        if weak:
            t = t | self.env.get(key, CLEAN)
        self.env[key] = t
        if key.startswith("self.") and self.func.cls is not None:
            self.prog.set_class_attr(self.func.cls, key[5:], substitute(t, self.func.param_taint))

    def bind(self, target: ast.AST, t: frozenset, value: ast.AST | None = None, ctrl: frozenset = CLEAN) -> None:
        if isinstance(target, (ast.Tuple, ast.List)) and isinstance(value, (ast.Tuple, ast.List)) \
                and len(target.elts) == len(value.elts):
            for tt, vv in zip(target.elts, value.elts):  # element by element: `rank, world = ...`
                self.bind(tt, self.ev(vv) | ctrl, vv, ctrl)
            return
        if isinstance(target, ast.Subscript) or (isinstance(target, ast.Attribute) and dotted(target) is None):
            base = dotted(target.value) if isinstance(target, (ast.Subscript, ast.Attribute)) else None
            if base is not None:
                self.assign(base, t, weak=True)
            return
        names: list[str] = []
        _assigned_names(target, names)
        for n in names:
            self.assign(n, t)

    def bind_items(self, target: ast.AST, iterable: ast.AST, it: frozenset, ctrl: frozenset) -> None:
        """A ``for`` target: the iterable's items (``shards.items``: a sharded loader's items are
        this rank's data); ``enumerate``'s count is not data, only the rank can make it differ."""
        if isinstance(target, ast.Tuple) and len(target.elts) == 2 and _enumerates(iterable):
            self.bind(target.elts[0], strip_data(it) | ctrl)
            self.bind(target.elts[1], items(it) | ctrl)
            return
        self.bind(target, items(it) | ctrl)

    def merge(self, envs: list[dict]) -> None:
        if not envs:
            return
        keys = set()
        for e in envs:
            keys |= e.keys()
        out = {}
        for k in keys:
            t = CLEAN
            for e in envs:
                v = e.get(k)
                if v is None:
                    v = self.env.get(k, CLEAN)
                t = t | v
            out[k] = t
        self.env = out

    def sub(self, stmts, ctrl) -> tuple[dict, bool]:
        saved = self.env
        self.env = dict(saved)
        exits = self.block(stmts, ctrl)
        env = self.env
        self.env = saved
        return env, exits

    def stmt(self, s: ast.stmt, ctrl: frozenset) -> None:
        ev = self.ev
        if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return
        if isinstance(s, _SIMPLE):
            for x in outer_ifexps(s):  # `a() if cond else b()`: a condition like an `if`'s
                self.record_test(x, ev(x.test))
        if isinstance(s, ast.Assign):
            t = ev(s.value)
            if not _rewraps(s):  # `pbar = tqdm(pbar)` on rank 0 only: the same items everywhere
                t = t | ctrl
            for tgt in s.targets:
                self.bind(tgt, t, s.value, ctrl)
            self.after_calls(s.value)
            if len(s.targets) == 1 and isinstance(s.targets[0], ast.Name):
                self.note_display(s.targets[0].id, s.value)
                self.last_value[s.targets[0].id] = ast.dump(s.value)
        elif isinstance(s, ast.AnnAssign):
            if s.value is not None:
                self.bind(s.target, ev(s.value) | ctrl, s.value, ctrl)
                self.after_calls(s.value)
        elif isinstance(s, ast.AugAssign):
            t = ev(s.value) | ev(s.target) | ctrl
            self.bind(s.target, t)
        elif isinstance(s, ast.Expr):
            ev(s.value)
            self.mutation(s.value, ctrl)
            self.after_calls(s.value)
        elif isinstance(s, ast.Return):
            self.returns = self.returns | ev(s.value) | ctrl
        elif isinstance(s, ast.If):
            t = ev(s.test)
            self.record_test(s, t)
            c = ctrl | t
            before = dict(self.last_value)
            e1, x1 = self.sub(s.body, c)
            e2, x2 = self.sub(s.orelse, c)
            side = _distributed_side(s.test)
            if side is not None and not (x1 if side else x2):
                # `if RANK != -1:` (DDP) vs a single process: rank dependence exists on one side only
                self.env = e1 if side else e2
            else:
                self.merge([e for e, x in ((e1, x1), (e2, x2)) if not x] or [e1, e2])
            self.took_broadcast(s, before)
        elif isinstance(s, (ast.For, ast.AsyncFor)):
            it = ev(s.iter)
            # the trip count: a list of this rank's batches is as long as the others' (a padded
            # sampler); only the rank makes it differ (``shards``)
            self.record_test(s, strip_data(it))
            for _ in range(2):
                self.bind_items(s.target, s.iter, it, ctrl)
                e1, _x = self.sub(s.body, ctrl | it)
                self.merge([self.env, e1])
            if s.orelse:
                self.block(s.orelse, ctrl)
        elif isinstance(s, ast.While):
            for _ in range(2):
                t = ev(s.test)
                e1, _x = self.sub(s.body, ctrl | t)
                self.merge([self.env, e1])
            self.record_test(s, ev(s.test))
            if s.orelse:
                self.block(s.orelse, ctrl)
        elif isinstance(s, (ast.With, ast.AsyncWith)):
            for item in s.items:
                t = ev(item.context_expr)
                if item.optional_vars is not None:
                    self.bind(item.optional_vars, t | ctrl)
            self.block(s.body, ctrl)
        elif isinstance(s, ast.Try) or type(s).__name__ == "TryStar":
            e1, x1 = self.sub(s.body, ctrl)
            envs = [e1] if not x1 else []
            for h in s.handlers:
                self.env, saved = {**self.env, **e1}, self.env
                eh, xh = self.sub(h.body, ctrl)
                self.env = saved
                if not xh:
                    envs.append(eh)
            self.merge(envs or [e1])
            if s.orelse:
                self.block(s.orelse, ctrl)
            if s.finalbody:
                self.block(s.finalbody, ctrl)
        elif isinstance(s, ast.Assert):
            self.record_test(s, ev(s.test))
        elif type(s).__name__ == "Match":
            subj = ev(s.subject)
            envs = []
            for case in s.cases:
                e, x = self.sub(case.body, ctrl | subj)
                if not x:
                    envs.append(e)
            self.merge(envs + [dict(self.env)])
        else:
            for child in ast.iter_child_nodes(s):
                if isinstance(child, ast.expr):
                    ev(child)

    def record_test(self, node: ast.AST, t: frozenset) -> None:
        if self.final:
            self.facts.tests[id(node)] = t

    def mutation(self, expr: ast.AST, ctrl: frozenset) -> None:
        """``losses.append(loss.item())`` / ``meter.update(loss.item())``: the container now holds
        what was put in it. ``meter.all_reduce()`` / ``logger.synchronize_between_processes()``:
        a method named for a collective made the object the same on every rank."""
        if not (isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute)):
            return
        key = dotted(expr.func.value)
        if key is None or key not in self.env:
            return  # an object of another scope, or a module: not tracked here
        name = expr.func.attr
        if name in SYNC_METHODS:
            self.env[key] = CLEAN
        elif name in MUTATORS:
            t = CLEAN
            for a in expr.args:
                t = t | self.ev(a)
            for kw in expr.keywords:
                t = t | self.ev(kw.value)
            if t or ctrl:
                self.assign(key, t | ctrl, weak=True)

    def note_display(self, key: str, value: ast.AST) -> None:
        if isinstance(value, (ast.List, ast.Tuple)):
            # what the source rank sent: the names read, and each element (either side of
            # `stop if RANK == 0 else None`) as text, to match `stop = <the same expression>`
            sent = {n.id for e in value.elts for n in ast.walk(e) if isinstance(n, ast.Name)}
            for e in value.elts:
                sent.update(ast.dump(x) for x in ((e.body, e.orelse) if isinstance(e, ast.IfExp) else (e,)))
            self.displays[key] = frozenset(sent)
        else:
            self.displays.pop(key, None)
            self.broadcast.pop(key, None)

    def took_broadcast(self, s: ast.If, before: dict[str, str]) -> None:
        """``objs = [stop if RANK == 0 else None]; broadcast_object_list(objs, 0)`` then ``if
        RANK != 0: stop = objs[0]``: the source rank kept the value it sent, every other rank took
        it, so ``stop`` is the same everywhere (YOLOv5's early stopping). Only when the branch is
        skipped on the source rank alone (its test decided for ranks 0-7) and has no else."""
        if s.orelse or not self.broadcast:
            return
        names = {n.id for n in ast.walk(s.test) if isinstance(n, ast.Name)}
        if len(names) != 1:
            return
        rank_name = names.pop()
        for st in s.body:
            if not (isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name)
                    and isinstance(st.value, ast.Subscript)):
                continue
            got = self.broadcast.get(dotted(st.value.value) or "")
            v = st.targets[0].id
            if got is None or (v not in got[0] and before.get(v) not in got[0]):
                continue
            src = got[1]
            if decide(s.test, {rank_name: src}) is False and \
                    all(decide(s.test, {rank_name: r}) is True for r in range(8) if r != src):
                self.env[v] = CLEAN

    def after_calls(self, expr: ast.AST) -> None:
        """An in-place collective over the whole world makes its tensor/list uniform."""
        if not isinstance(expr, ast.Call):
            return
        canon = (self.func.module.imports.canonical(expr.func) or "").replace(".distributed_c10d.", ".")
        if not canon.startswith("torch.distributed."):
            return
        name = canon.rsplit(".", 1)[-1]
        spec = UNIFORMING.get(name)
        if spec is None:
            return
        # On a subgroup the result is the same among its members, which are the ranks that go on
        # to use it in that group's collectives: treated as uniform too.
        idx, kw = spec
        arg = expr.args[idx] if len(expr.args) > idx else next(
            (k.value for k in expr.keywords if k.arg == kw), None)
        key = dotted(arg) if arg is not None else None
        if key is not None:
            self.env[key] = CLEAN
            if name == "broadcast_object_list" and key in self.displays:
                src = expr.args[1] if len(expr.args) > 1 else next(
                    (k.value for k in expr.keywords if k.arg == "src"), ast.Constant(0))
                if isinstance(src, ast.Constant) and isinstance(src.value, int):
                    self.broadcast[key] = (self.displays[key], src.value)
