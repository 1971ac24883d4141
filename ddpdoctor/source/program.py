"""The analysed program: parsed files, their functions and classes, calls resolved between them,
and the whole-program fixpoint of the rank-dependence analysis (function results, parameters
given rank-dependent arguments, attributes set in one method and read in another)."""

from __future__ import annotations

import ast

from .flow import Walker
from .names import dotted
from .shards import strip_sources
from .taint import CLEAN, RANK_PARAMS, Evaluator, substitute
from .units import Facts, Func, Module

SPAWN_FUNCS = frozenset({"torch.multiprocessing.spawn", "torch.multiprocessing.start_processes",
                         "torch.multiprocessing.spawn.spawn", "ddpdoctor.spawn", "ddpdoctor.testing.spawn"})
MAX_ROUNDS = 4


class Program:
    """Everything the rules need about the files given."""

    def __init__(self, modules: list[Module], extra_names=(), comm_names=()) -> None:
        self.modules = modules
        self.extra_names = frozenset(extra_names)
        self.comm_names = frozenset(comm_names)
        self.funcs: list[Func] = []
        self.module_funcs: dict[tuple[str, str], Func] = {}
        self.module_func: dict[str, Func] = {}
        self.classes: dict[str, list[tuple[Module, ast.ClassDef]]] = {}
        self.methods: dict[tuple[int, str], Func] = {}
        self.nested: dict[tuple[int, str], Func] = {}
        self.class_attr: dict[int, dict[str, frozenset]] = {}
        self.module_env: dict[str, dict[str, frozenset]] = {}
        self.by_module_name: dict[str, list[Module]] = {}
        self.func_of_node: dict[int, Func] = {}
        self._changed_classes: set[int] = set()
        self.notes: list[str] = []
        self.skipped: set[int] = set()
        for m in modules:
            self.by_module_name.setdefault(m.name, []).append(m)
            self._index(m)
        self._spawn_targets()
        self._fixpoint()

    @classmethod
    def from_sources(cls, sources: dict[str, str], **kw) -> Program:
        return cls([Module(p, s) for p, s in sources.items()], **kw)

    # -- indexing --------------------------------------------------------------------------------
    def _index(self, m: Module) -> None:
        top = Func(m, m.tree, None, None, f"{m.name}")
        self.funcs.append(top)
        self.module_func[m.path] = top

        def visit(body, cls, parent, prefix):
            for s in body:
                if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    f = Func(m, s, cls, parent, f"{prefix}{s.name}")
                    self.funcs.append(f)
                    self.func_of_node[id(s)] = f
                    if cls is not None and parent is None:
                        self.methods[(id(cls), s.name)] = f
                    elif parent is not None:
                        self.nested[(id(parent.node), s.name)] = f
                    else:
                        self.module_funcs[(m.path, s.name)] = f
                    visit(s.body, None, f, f"{prefix}{s.name}.")
                elif isinstance(s, ast.ClassDef):
                    self.classes.setdefault(s.name, []).append((m, s))
                    visit(s.body, s, None, f"{prefix}{s.name}.")
                else:  # defs under if/try/with at top level still count
                    for sub in ("body", "orelse", "finalbody"):
                        if isinstance(getattr(s, sub, None), list):
                            visit(getattr(s, sub), cls, parent, prefix)
                    for h in getattr(s, "handlers", []) or []:
                        visit(h.body, cls, parent, prefix)

        visit(m.tree.body, None, None, f"{m.name}.")

    def _spawn_targets(self) -> None:
        for f in self.funcs:
            if "spawn" not in f.module.source and "start_processes" not in f.module.source:
                continue
            for node in f.call_nodes:
                if node.args:
                    canon = f.module.imports.canonical(node.func) or ""
                    if canon in SPAWN_FUNCS:
                        target = self._resolve_name(node.args[0], f)
                        if target is not None and target.params:
                            target.param_taint[0] |= frozenset(
                                {f"the rank {dotted(node.func)}() passes (line {node.lineno})"})
        for f in self.funcs:
            for i, p in enumerate(f.params):
                if p in RANK_PARAMS or p in self.extra_names:
                    f.param_taint[i] |= frozenset({f"~parameter `{p}` of {f.name}()"})

    # -- resolution ------------------------------------------------------------------------------
    def class_named(self, name: str, module: Module | None = None) -> ast.ClassDef | None:
        """The analysed class of that name: the one of ``module`` or of the module it imports the
        name from, else the only one in the program (None when ambiguous)."""
        found = self.classes.get(name)
        if not found:
            return None
        if module is not None and len(found) > 1:
            for m, c in found:
                if m is module:
                    return c
            canon = module.imports.alias.get(name)
            if canon:
                src = canon.rpartition(".")[0].rsplit(".", 1)[-1]
                for m, c in found:
                    if m.name == src:
                        return c
        return found[0][1] if len(found) == 1 else None

    def _module_of(self, cls: ast.ClassDef) -> Module | None:
        for m, c in self.classes.get(cls.name, ()):
            if c is cls:
                return m
        return None

    def method(self, cls: ast.ClassDef, name: str, depth: int = 0) -> Func | None:
        f = self.methods.get((id(cls), name))
        if f is not None or depth > 5:
            return f
        for b in cls.bases:
            base = dotted(b)
            bc = self.class_named(base.rsplit(".", 1)[-1], self._module_of(cls)) if base else None
            if bc is not None and bc is not cls:
                f = self.method(bc, name, depth + 1)
                if f is not None:
                    return f
        return None

    def _resolve_name(self, node: ast.AST, func: Func) -> Func | None:
        if not isinstance(node, ast.Name):
            return None
        n = node.id
        p = func
        while p is not None and not p.is_module:
            f = self.nested.get((id(p.node), n))
            if f is not None:
                return f
            p = p.parent
        f = self.module_funcs.get((func.module.path, n))
        if f is not None:
            return f
        canon = func.module.imports.alias.get(n)
        if canon:
            mod, _, name = canon.rpartition(".")
            for m in self.by_module_name.get(mod.rsplit(".", 1)[-1], []):
                f = self.module_funcs.get((m.path, name))
                if f is not None:
                    return f
        return None

    def instance_class(self, expr: ast.AST, func: Func, line: int) -> ast.ClassDef | None:
        """The analysed class an expression is an instance of, when it was built in view."""
        if isinstance(expr, ast.Call):
            name = dotted(expr.func)
            return self.class_named(name.rsplit(".", 1)[-1], func.module) if name else None
        key = dotted(expr)
        if key is None:
            return None
        value = self.last_assignment(func, key, line)
        if value is not None and value is not expr:
            return self.instance_class(value, func, 10 ** 9) if isinstance(value, ast.Call) else None
        return None

    def last_assignment(self, func: Func, key: str, line: int) -> ast.AST | None:
        """The value last assigned to ``key`` before ``line`` in the function (``self.x``: anywhere
        in the class; a global: in the module's top-level code)."""
        best = None
        for ln, value in self.assignments_by_key(func).get(key, ()):
            if ln < line:
                best = value
        if best is None and key.startswith("self.") and func.cls is not None:
            for m in self._class_funcs(func.cls):
                for _ln, value in self.assignments_by_key(m).get(key, ()):
                    best = value
        if best is None and not func.is_module and "." not in key:
            top = self.module_func[func.module.path]
            for _ln, value in self.assignments_by_key(top).get(key, ()):
                best = value
        return best

    def assignments_by_key(self, func: Func) -> dict[str, list[tuple[int, ast.AST]]]:
        got = func.__dict__.get("_by_key")
        if got is None:
            got = {}
            for ln, target, value in self.assignments(func):
                got.setdefault(target, []).append((ln, value))
            func.__dict__["_by_key"] = got
        return got

    def _class_funcs(self, cls: ast.ClassDef) -> list[Func]:
        idx = self.__dict__.get("_class_funcs_idx")
        if idx is None:
            idx = {}
            for (cid, _n), f in self.methods.items():
                idx.setdefault(cid, []).append(f)
            self.__dict__["_class_funcs_idx"] = idx
        return idx.get(id(cls), [])

    _assign_cache: dict

    def assignments(self, func: Func) -> list[tuple[int, str, ast.AST]]:
        """(line, target key, value) for simple assignments in the function, in order."""
        cache = self.__dict__.setdefault("_assign_cache", {})
        got = cache.get(id(func))
        if got is not None:
            return got
        out = []
        for node in func.scope:
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    if isinstance(t, (ast.Tuple, ast.List)):
                        v = node.value
                        pairwise = isinstance(v, (ast.Tuple, ast.List)) and len(v.elts) == len(t.elts)
                        prepared = _prepare_call(v) and len(v.args) == len(t.elts)
                        for i, e in enumerate(t.elts):
                            k = dotted(e)
                            if k and prepared:  # `model, opt = accelerator.prepare(model, opt)`
                                out.append((node.lineno, k, _prepared(v, v.args[i])))
                            elif k:  # `rank, world = dist.get_rank(), dist.get_world_size()`: element-wise
                                out.append((node.lineno, k, v.elts[i] if pairwise else v))
                    elif _prepare_call(node.value) and len(node.value.args) == 1 and dotted(t):
                        out.append((node.lineno, dotted(t), _prepared(node.value, node.value.args[0])))
                    else:
                        k = dotted(t)
                        if k:
                            out.append((node.lineno, k, node.value))
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                k = dotted(node.target)
                if k:
                    out.append((node.lineno, k, node.value))
            elif isinstance(node, (ast.With, ast.AsyncWith)):
                for it in node.items:
                    k = dotted(it.optional_vars) if it.optional_vars is not None else None
                    if k:
                        out.append((node.lineno, k, it.context_expr))
        out.sort(key=lambda x: x[0])
        cache[id(func)] = out
        return out

    def resolve(self, call: ast.Call, func: Func) -> tuple[Func | None, bool]:
        """The analysed function a call runs, and whether ``self`` is bound (method, class)."""
        f = call.func
        if isinstance(f, ast.Name):
            target = self._resolve_name(f, func)
            if target is not None:
                return target, False
            cls = self.class_named(f.id, func.module) if (f.id in self.classes) else None
            if cls is not None:
                init = self.method(cls, "__init__")
                return (init, True) if init is not None else (None, False)
            return None, False
        if isinstance(f, ast.Attribute):
            base = f.value
            if isinstance(base, ast.Name) and base.id == "self" and func.cls is not None:
                m = self.method(func.cls, f.attr)
                if m is not None:
                    return m, not m.is_static
            if isinstance(base, ast.Name) and base.id == "super" or (
                    isinstance(base, ast.Call) and dotted(base.func) == "super"):
                return None, False
            canon = func.module.imports.alias.get(base.id) if isinstance(base, ast.Name) else None
            if canon is not None:
                for m in self.by_module_name.get(canon.rsplit(".", 1)[-1], []):
                    target = self.module_funcs.get((m.path, f.attr))
                    if target is not None:
                        return target, False
                return None, False
            cls = self.instance_class(base, func, call.lineno)
            if cls is not None:
                m = self.method(cls, f.attr)
                if m is not None:
                    return m, not m.is_static
        return None, False

    # -- the fixpoint ----------------------------------------------------------------------------
    def note_call(self, caller: Func, callee: Func, params: list[frozenset]) -> None:
        caller.calls.append((callee, params))

    def set_class_attr(self, cls: ast.ClassDef, attr: str, t: frozenset) -> None:
        d = self.class_attr.setdefault(id(cls), {})
        old = d.get(attr, CLEAN)
        new = old | t
        if new != old:
            d[attr] = new
            self._changed_classes.add(id(cls))
        elif attr not in d:
            d[attr] = new

    def outer_taint(self, func: Func, key: str) -> frozenset | None:
        """Taint of a name/attribute not assigned in the function so far."""
        if key.startswith("self.") and func.cls is not None:
            attr = key[5:]
            if "." not in attr:
                t = self.class_attr.get(id(func.cls), {}).get(attr)
                if t is not None:
                    return substitute_markers_away(t)
            return None
        head = key.split(".", 1)[0]
        p = func.parent
        while p is not None:
            if key in p.final_env:
                return substitute_markers_away(p.final_env[key], p)
            p = p.parent
        if not func.is_module:
            env = self.module_env.get(func.module.path, {})
            if key in env:
                return env[key]
            if head in env and "." in key:
                return None
        return None

    def _fixpoint(self) -> None:
        # A worklist: every function is walked once (recording its facts); a function is walked
        # again when something it reads changed: a callee's result, its own parameters' taint,
        # an attribute of its class, its module's globals. The facts of its last walk are final.
        order = sorted(self.funcs, key=lambda f: (not f.is_module,))
        callers: dict[int, set[int]] = {}
        by_id = {id(f): f for f in order}
        pending = list(order)
        walks = 0
        limit = MAX_ROUNDS * len(order) + 1
        while pending and walks < limit:
            queued = {id(f) for f in pending}
            nxt: list[Func] = []
            self._changed_classes = set()
            changed_modules = set()
            for f in pending:
                old_returns = f.returns
                old_env = self.module_env.get(f.module.path) if f.is_module else None
                f.calls = []
                f.facts = Facts()
                w = Walker(self, f, True)
                try:
                    w.run()
                except RecursionError:  # an absurdly deep expression: this function is skipped
                    self.skip(f)
                    f.facts = Facts()
                walks += 1
                f.final_env = w.env
                for callee, _p in f.calls:
                    callers.setdefault(id(callee), set()).add(id(f))
                if f.returns != old_returns:
                    nxt.extend(by_id[c] for c in callers.get(id(f), ()))
                if f.is_module and old_env is not None and self.module_env.get(f.module.path) != old_env:
                    changed_modules.add(f.module.path)
                for callee, params in f.calls:
                    for i, t in enumerate(params):
                        if i < len(callee.param_taint) and t:
                            c = substitute(t, f.param_taint)
                            if not c <= callee.param_taint[i]:
                                callee.param_taint[i] = callee.param_taint[i] | c
                                nxt.append(callee)
            for f in order:
                if (f.cls is not None and id(f.cls) in self._changed_classes) or \
                        (f.module.path in changed_modules and not f.is_module):
                    nxt.append(f)
            seen: set[int] = set()
            pending = []
            for f in nxt:
                if id(f) not in seen:
                    seen.add(id(f))
                    pending.append(f)
            del queued

    def skip(self, f: Func) -> None:
        """Note (once) a function too deeply nested to analyse."""
        if id(f) not in self.skipped:
            self.skipped.add(id(f))
            line = getattr(f.node, "lineno", 1)
            self.notes.append(f"{f.module.display}:{line}: {f.name} is nested too deeply to analyse; skipped")

    # -- queries ---------------------------------------------------------------------------------
    def taint(self, func: Func, expr: ast.AST) -> frozenset:
        """The (concrete) taint of an expression read in ``func``, from the recorded walk."""
        loads = func.facts.loads

        def lookup(node, key):
            return loads.get(id(node))

        def call_result(call, args, kws):
            callee, bound = self.resolve(call, func)
            if callee is None:
                return None
            params = ([CLEAN] if bound else []) + list(args)
            return substitute(callee.returns, params)

        t = Evaluator(func.module.imports, lookup, call_result, self.extra_names)(expr)
        return strip_sources(substitute(t, func.param_taint))

    def test_taint(self, func: Func, node: ast.AST) -> frozenset:
        """The taint of a recorded condition (a ``for``'s: its iterable). A sharded loader is the
        same length everywhere (``shards``): only its items are this rank's data."""
        t = func.facts.tests.get(id(node))
        if t is None:
            return CLEAN
        return strip_sources(substitute(t, func.param_taint))

    def func_at(self, module: Module, line: int) -> Func:
        """The innermost function of ``module`` whose source spans ``line`` (else its top level)."""
        idx = self.__dict__.get("_func_idx")
        if idx is None:
            idx = self.__dict__["_func_idx"] = {}
            for f in self.funcs:
                if not f.is_module:
                    idx.setdefault(f.module.path, []).append(f)
        funcs = idx.get(module.path, ())
        best = self.module_func[module.path]
        for f in funcs:
            n = f.node
            if n.lineno <= line <= (n.end_lineno or n.lineno):
                if best.is_module or n.lineno >= best.node.lineno:
                    best = f
        return best


def substitute_markers_away(t: frozenset, func: Func | None = None) -> frozenset:
    """Taint read from another function's state: its parameter markers become its parameters'
    taint (or nothing when not known)."""
    if not any(r.lstrip("~").startswith("@") for r in t):
        return t
    return substitute(t, func.param_taint if func is not None else [])


def _prepare_call(v: ast.AST) -> bool:
    return isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute) and v.func.attr == "prepare" and \
        (dotted(v.func.value) or "").rsplit(".", 1)[-1] in ("accelerator", "accel", "fabric")


def _prepared(call: ast.Call, arg: ast.AST) -> ast.Call:
    """A stand-in for what ``accelerator.prepare`` returns for ``arg`` (read by comm.kind)."""
    node = ast.Call(func=ast.Name(id="__prepared__", ctx=ast.Load()), args=[arg], keywords=[])
    return ast.copy_location(node, call)
