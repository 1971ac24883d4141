"""The communication model: which calls make the ranks communicate.

Every ``torch.distributed`` collective, point-to-point call, barrier, object collective and group
creation; calling a DDP- or FSDP-wrapped model (DDP's forward broadcasts buffers when the model
has any) and ``backward()`` of a loss computed from a DDP model (the gradient all-reduce);
``accelerator.gather / reduce / wait_for_everyone / gather_for_metrics / backward``; a metric's
``compute()``/``sync()`` (torchmetrics, torcheval); user functions named in the settings; and any
function of the analysed files that does one of these, transitively.
"""

from __future__ import annotations

import ast
import bisect
from dataclasses import dataclass

from ..source.consts import decide
from ..source.names import dotted, outer_ifexps
from ..source.program import Program
from ..source.units import Func, walk_scope
from . import callconsts

COLLECTIVES = frozenset({
    "all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor", "_all_gather_base",
    "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base", "all_to_all", "all_to_all_single",
    "gather", "scatter", "all_gather_object", "gather_object", "broadcast_object_list",
    "scatter_object_list", "all_reduce_coalesced", "all_gather_coalesced", "barrier", "monitored_barrier",
    "new_group", "new_subgroups", "new_subgroups_by_enumeration", "init_process_group", "init_device_mesh",
})
P2P = frozenset({"send", "recv", "isend", "irecv", "batch_isend_irecv", "send_object_list", "recv_object_list"})
DDP_CTORS = frozenset({"torch.nn.parallel.DistributedDataParallel",
                       "torch.nn.parallel.distributed.DistributedDataParallel", "DistributedDataParallel", "DDP"})
FSDP_CTORS = frozenset({"torch.distributed.fsdp.FullyShardedDataParallel",
                        "torch.distributed.fsdp.fully_sharded_data_parallel.FullyShardedDataParallel",
                        "FullyShardedDataParallel", "FSDP"})
#: torch.nn layers that hold buffers (running statistics), so a DDP forward broadcasts them.
BUFFERED = frozenset({"BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm", "LazyBatchNorm1d",
                      "LazyBatchNorm2d", "LazyBatchNorm3d"})
CONTAINERS = frozenset({"Sequential", "ModuleList", "ModuleDict"})
ACCEL_COMM = frozenset({"gather", "reduce", "wait_for_everyone", "gather_for_metrics",
                        "pad_across_processes", "backward", "broadcast"})
METRIC_PREFIXES = ("torchmetrics.", "torcheval.metrics.")
#: Synthetic callee that stands for "element i of accelerator.prepare(...)" (see Program.assignments).
PREPARED = "__prepared__"


@dataclass(frozen=True)
class Comm:
    """One communication: ``op`` names it; ``sure`` is False when it depends on something not
    in view (a DDP model whose buffers are unknown); ``via`` is the chain of user calls."""

    op: str
    line: int
    sure: bool
    what: str
    p2p: bool = False
    subgroup: bool = False
    via: tuple = ()

    @property
    def key(self) -> str:
        return self.op


def _canon(prog: Program, func: Func, node: ast.AST) -> str:
    return (func.module.imports.canonical(node) or "").replace(".distributed_c10d.", ".")


class CommModel:
    """Classifies calls and summarises functions, with caches."""

    def __init__(self, prog: Program) -> None:
        self.prog = prog
        self._seq: dict[int, list] = {}
        self._busy: set[int] = set()
        self._kind: dict = {}
        self._calls: dict[int, list] = {}
        self._stmt: dict[int, list] = {}
        self._given: dict[tuple, list] = {}

    # -- kinds of values -------------------------------------------------------------------------
    def kind(self, expr: ast.AST, func: Func, line: int, depth: int = 0) -> tuple | None:
        """('ddp', buffers True/False/None) | ('fsdp',) | ('accelerator',) | ('metric',) |
        ('syncbn',) for the value an expression holds at ``line``, else None."""
        if depth > 4:
            return None
        if isinstance(expr, ast.Call):
            canon = _canon(self.prog, func, expr.func)
            last = canon.rsplit(".", 1)[-1]
            if canon in DDP_CTORS or last in ("DistributedDataParallel",):
                if any(kw.arg == "broadcast_buffers" and isinstance(kw.value, ast.Constant)
                       and kw.value.value is False for kw in expr.keywords):
                    return ("ddp", False)
                mod = expr.args[0] if expr.args else next((k.value for k in expr.keywords if k.arg == "module"), None)
                return ("ddp", self.buffers(mod, func, line, depth + 1) if mod is not None else None)
            if canon in FSDP_CTORS or last == "FullyShardedDataParallel":
                return ("fsdp",)
            if last == "convert_sync_batchnorm":
                return ("syncbn",)
            if canon.startswith(METRIC_PREFIXES):
                return ("metric",)
            if last == "Accelerator" or last == "Fabric":
                return ("accelerator",)
            if last == PREPARED and expr.args:
                # accelerator.prepare(model, ...): the model comes back wrapped in DDP when the job
                # is distributed; its buffers are those of the module given
                inner = expr.args[0]
                return ("ddp", self.buffers(inner, func, line, depth + 1)) if self._looks_like_model(
                    inner, func, line) else None
            if isinstance(expr.func, ast.Attribute) and expr.func.attr in ("to", "cuda", "cpu", "train", "float",
                                                                          "half", "bfloat16", "double"):
                return self.kind(expr.func.value, func, line, depth + 1)
            callee, _b = self.prog.resolve(expr, func)
            if callee is not None and not callee.is_module and callee is not func:
                # a helper that builds the model: the kind of what it returns
                for node in walk_scope(callee.node):
                    if isinstance(node, ast.Return) and node.value is not None:
                        k = self.kind(node.value, callee, node.lineno, depth + 1)
                        if k is not None:
                            return k
            return None
        if isinstance(expr, ast.IfExp):
            return self.kind(expr.body, func, line, depth + 1) or self.kind(expr.orelse, func, line, depth + 1)
        key = dotted(expr)
        if key is None:
            return None
        if key.split(".")[-1] in ("accelerator", "fabric"):
            return ("accelerator",)
        ck = (id(func), key, line)
        if ck in self._kind:
            return self._kind[ck]
        self._kind[ck] = None
        value = self.prog.last_assignment(func, key, line)
        owner = self.prog.func_at(func.module, value.lineno) if value is not None else func
        out = self.kind(value, owner, getattr(value, "lineno", line), depth + 1) if value is not None else None
        self._kind[ck] = out
        return out

    def _looks_like_model(self, expr: ast.AST, func: Func, line: int) -> bool:
        """Whether an argument of ``accelerator.prepare`` is the model (not the optimizer,
        loader or scheduler): built from torch.nn or a Module class, or named like one."""
        key = dotted(expr) or ""
        name = key.rsplit(".", 1)[-1].lower()
        if any(w in name for w in ("optim", "loader", "sched", "data")):
            return False
        value = self.prog.last_assignment(func, key, line) if key else None
        if isinstance(value, ast.Call):
            canon = _canon(self.prog, func, value.func)
            if canon.startswith("torch.nn.") or canon.startswith("transformers."):
                return True
        return any(w in name for w in ("model", "net", "module", "encoder", "decoder"))

    def buffers(self, mod: ast.AST, func: Func, line: int, depth: int = 0) -> bool | None:
        """Whether a module expression holds buffers: True, False, or None (not in view)."""
        if depth > 10 or mod is None:
            return None
        if isinstance(mod, ast.Call):
            canon = _canon(self.prog, func, mod.func)
            last = canon.rsplit(".", 1)[-1]
            if last in BUFFERED:
                return True
            if last == "convert_sync_batchnorm":
                inner = self.buffers(mod.args[0], func, line, depth + 1) if mod.args else None
                return inner
            if isinstance(mod.func, ast.Attribute) and mod.func.attr in ("to", "cuda", "cpu", "float", "half",
                                                                         "train", "eval"):
                return self.buffers(mod.func.value, func, line, depth + 1)
            if canon in DDP_CTORS or canon == "torch.compile" or last in ("DistributedDataParallel", "compile"):
                inner = mod.args[0] if mod.args else None
                return self.buffers(inner, func, line, depth + 1) if inner is not None else None
            if canon.startswith("torch.nn.") and not canon.startswith("torch.nn.parallel.") and last[:1].isupper():
                if last in CONTAINERS:
                    if any(isinstance(a, ast.Starred) for a in mod.args):
                        return None
                    parts = [self.buffers(a, func, line, depth + 1) for a in mod.args]
                    if any(p is True for p in parts):
                        return True
                    return False if all(p is False for p in parts) else None
                if last.startswith("InstanceNorm"):
                    return any(kw.arg == "track_running_stats" and isinstance(kw.value, ast.Constant)
                               and kw.value.value is True for kw in mod.keywords)
                return False
            cls = self.prog.class_named(last, func.module) if last in self.prog.classes else None
            if cls is not None:
                return self.class_buffers(cls)
            return None
        key = dotted(mod)
        if key is not None:
            value = self.prog.last_assignment(func, key, line)
            if value is not None and value is not mod:
                owner = self.prog.func_at(func.module, value.lineno)
                return self.buffers(value, owner, getattr(value, "lineno", line), depth + 1)
        return None

    def class_buffers(self, cls: ast.ClassDef, depth: int = 0) -> bool | None:
        """Whether a module class of the analysed code holds buffers, from what its ``__init__``
        builds: True when it builds a buffered layer, False when it builds only buffer-free
        torch.nn layers and buffer-free classes of its own (and registers no buffer), None when
        anything else is involved (a module passed in, a factory out of view, register_buffer)."""
        if depth > 8 or not any("Module" in (dotted(b) or "") for b in cls.bases):
            return None
        init = self.prog.method(cls, "__init__")
        if init is None:
            return None
        params = set(init.params[1:])
        conditional = set()  # calls made only on some paths (`BatchNorm1d(n) if norm else LayerNorm(n)`)
        for node in init.scope:
            if isinstance(node, (ast.If, ast.IfExp)):
                for part in (node.body, node.orelse):
                    for sub in (part if isinstance(part, list) else [part]):
                        conditional.update(id(c) for c in ast.walk(sub) if isinstance(c, ast.Call))
        verdict: bool | None = False
        for node in init.scope:
            if isinstance(node, ast.Call):
                canon = _canon(self.prog, init, node.func)
                last = canon.rsplit(".", 1)[-1]
                if isinstance(node.func, ast.Attribute) and node.func.attr == "register_buffer":
                    return None
                if last in BUFFERED:
                    if id(node) in conditional:
                        verdict = None
                        continue
                    return True
                if canon.startswith("torch.nn.") and not canon.startswith("torch.nn.parallel."):
                    if last.startswith("InstanceNorm") or last.startswith("LazyInstanceNorm"):
                        verdict = None
                    continue
                sub = self.prog.class_named(last, init.module) if last in self.prog.classes else None
                if sub is not None and sub is not cls:
                    b = self.class_buffers(sub, depth + 1)
                    if b is True:
                        return True
                    if b is None:
                        verdict = None
                    continue
                if dotted(node.func) in ("dict", "list", "tuple", "range", "len", "int", "float", "min", "max",
                                         "super", "zip", "enumerate", "getattr", "isinstance", "print"):
                    continue
                if isinstance(node.func, ast.Attribute) and (
                        node.func.attr == "__init__" or (dotted(node.func) or "").startswith("self.")):
                    continue  # super().__init__(), self.apply(init_fn), self._init_weights(...)
                verdict = None  # a factory or helper out of view
            elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Name) and node.value.id in params:
                for t in node.targets:
                    k = dotted(t)
                    if k and k.startswith("self.") and self._called(cls, k):
                        verdict = None  # a module passed in (it is called): its buffers are not in view
        return verdict

    def _called(self, cls: ast.ClassDef, key: str) -> bool:
        """Whether ``self.<attr>`` is called in some method of the class (a stored module is;
        a stored config is not)."""
        for m in self.prog._class_funcs(cls):
            for c in m.call_nodes:
                if dotted(c.func) == key:
                    return True
        return False

    def from_ddp(self, expr: ast.AST, func: Func, line: int, depth: int = 0) -> bool:
        """Whether an expression is computed from a DDP/FSDP model's output (a loss)."""
        if depth > 5:
            return False
        for node in ast.walk(expr):
            if isinstance(node, ast.Call):
                k = self.kind(node.func, func, node.lineno)
                if k is not None and k[0] in ("ddp", "fsdp"):
                    return True
            elif isinstance(node, (ast.Name, ast.Attribute)) and isinstance(getattr(node, "ctx", None), ast.Load):
                key = dotted(node)
                if key is None:
                    continue
                value = self.prog.last_assignment(func, key, line)
                if value is not None and value is not expr and self.from_ddp(value, func, line, depth + 1):
                    return True
        return False

    # -- calls -------------------------------------------------------------------------------------
    def classify(self, call: ast.Call, func: Func) -> Comm | Func | None:
        """A Comm for a communicating library call, the callee for a call into the analysed code
        (the caller inlines its summary), or None."""
        f = call.func
        canon = _canon(self.prog, func, f)
        last = canon.rsplit(".", 1)[-1]
        text = dotted(f) or last
        if canon.startswith("torch.distributed.") and (last in COLLECTIVES or last in P2P):
            group = next((kw.value for kw in call.keywords if kw.arg in ("group", "pg", "process_group")), None)
            sub = group is not None and not (isinstance(group, ast.Constant) and group.value is None) \
                and dotted(group) not in ("dist.group.WORLD", "torch.distributed.group.WORLD", "group.WORLD")
            if last in ("barrier", "monitored_barrier") and call.args:
                sub = True
            if last == "init_process_group" and any(kw.arg == "world_size" for kw in call.keywords):
                sub = True  # explicit membership: the group is formed by the processes that call it
            return Comm(last, call.lineno, True, f"{text}()", p2p=last in P2P, subgroup=sub)
        if canon.startswith("torch.distributed.") and last == "destroy_process_group":
            return None
        k = self.kind(f, func, call.lineno)
        if k is not None:
            if k[0] == "ddp":
                if k[1] is False:
                    return None
                how = "broadcasts its buffers" if k[1] else "broadcasts buffers if the model has any"
                return Comm("ddp-forward", call.lineno, bool(k[1]), f"the DDP forward `{text}(...)` ({how})")
            if k[0] == "fsdp":
                return Comm("fsdp-forward", call.lineno, True, f"the FSDP forward `{text}(...)` (all-gathers parameters)")
            if k[0] == "syncbn":
                return Comm("syncbn-forward", call.lineno, False,
                            f"`{text}(...)` (SyncBatchNorm all-reduces statistics in training mode)")
        if isinstance(f, ast.Attribute):
            if f.attr == "backward" and self.from_ddp(f.value, func, call.lineno):
                return Comm("ddp-backward", call.lineno, True,
                            f"`{dotted(f) or 'backward'}()` of a loss from a DDP model (gradient all-reduce)")
            rk = self.kind(f.value, func, call.lineno) if f.attr in ACCEL_COMM or f.attr in ("compute", "sync") else None
            if rk == ("accelerator",) and f.attr in ACCEL_COMM:
                return Comm(f"accelerator.{f.attr}", call.lineno, True, f"`{text}()`")
            if rk == ("metric",) and f.attr in ("compute", "sync"):
                return Comm(f"metric.{f.attr}", call.lineno, True, f"`{text}()` (syncs the metric's state)")
            lc = self._lightning(call, f, func)
            if lc is not None:
                return lc
        if text in self.prog.comm_names or text.rsplit(".", 1)[-1] in self.prog.comm_names:
            return Comm(text.rsplit(".", 1)[-1], call.lineno, True, f"`{text}()` (configured as communicating)")
        callee, _bound = self.prog.resolve(call, func)
        return callee

    def _lightning(self, call: ast.Call, f: ast.Attribute, func: Func) -> Comm | None:
        """PyTorch Lightning: ``self.log(..., sync_dist=True)`` / ``log_dict`` (an all-reduce),
        ``self.all_gather(...)`` in a LightningModule, ``<...>.strategy.barrier/broadcast/reduce``."""
        text = dotted(f) or f.attr
        if f.attr in ("log", "log_dict") and any(
                kw.arg == "sync_dist" and not (isinstance(kw.value, ast.Constant) and not kw.value.value)
                for kw in call.keywords):
            return Comm("lightning.log(sync_dist)", call.lineno, True, f"`{text}(..., sync_dist=True)` (an all-reduce)")
        if f.attr == "all_gather" and text == "self.all_gather" and func.cls is not None and any(
                "Lightning" in (dotted(b) or "") for b in func.cls.bases):
            return Comm("lightning.all_gather", call.lineno, True, f"`{text}()`")
        base = dotted(f.value) or ""
        if f.attr in ("barrier", "broadcast", "reduce") and (base.endswith(".strategy") or base == "strategy"):
            return Comm(f"strategy.{f.attr}", call.lineno, True, f"`{text}()`")
        return None

    # -- sequences ---------------------------------------------------------------------------------
    def calls_in(self, node: ast.AST, func: Func) -> list[ast.Call]:
        """Calls in an expression or simple statement of ``func``, in source order (not into
        nested defs): a slice of the function's sorted calls by source position."""
        got = self._calls.get(id(node))
        if got is None:
            calls = func.call_nodes
            starts = func.call_starts
            lo = bisect.bisect_left(starts, (node.lineno, node.col_offset))
            end = (node.end_lineno or node.lineno, node.end_col_offset or 0)
            hi = bisect.bisect_right(starts, end)
            got = [c for c in calls[lo:hi] if (c.end_lineno or c.lineno, c.end_col_offset or 0) <= end]
            self._calls[id(node)] = got
        return got

    def events_of_call(self, call: ast.Call, func: Func, consts: dict | None = None) -> list[tuple]:
        c = self.classify(call, func)
        if c is None:
            return []
        if isinstance(c, Comm):
            if c.p2p or c.subgroup:
                return []
            return [(c.key, c)]
        # the helper's branches that this call's constant arguments decide (callconsts)
        inner = callconsts.bound(call, c, self.prog.resolve(call, func)[1], consts or {})
        out = []
        for key, ev in (self.seq_given(c, inner) if inner else self.seq(c)):
            out.append((key, Comm(ev.op, call.lineno, ev.sure, ev.what, ev.p2p, ev.subgroup,
                                  ((c.name, ev.line, c.module.display),) + ev.via)))
        return out

    def seq(self, func: Func) -> list[tuple]:
        """The function's communication sequence: [(key, Comm)], keys comparable across paths."""
        got = self._seq.get(id(func))
        if got is not None:
            return got
        if id(func) in self._busy:
            return []  # recursion: counted once
        self._busy.add(id(func))
        try:
            out = self.block(func.body, func)
        except RecursionError:
            out = []
            self.prog.skip(func)
        self._busy.discard(id(func))
        self._seq[id(func)] = out
        return out

    def seq_given(self, func: Func, consts: dict) -> list[tuple]:
        """The function's sequence when its parameters ``consts`` hold those constants: the
        branches they decide are taken alone (``callconsts``)."""
        key = (id(func), tuple(sorted((k, repr(v)) for k, v in consts.items())))
        got = self._given.get(key)
        if got is not None:
            return got
        if id(func) in self._busy:
            return []
        self._busy.add(id(func))
        try:
            out = self.block(func.body, func, consts)
        except RecursionError:
            out = []
        self._busy.discard(id(func))
        self._given[key] = out
        return out

    def block(self, stmts: list[ast.stmt], func: Func, consts: dict | None = None) -> list[tuple]:
        out: list[tuple] = []
        for s in stmts:
            out.extend(self.stmt(s, func, consts))
        return out

    def stmt(self, s: ast.stmt, func: Func, consts: dict | None = None) -> list[tuple]:
        if consts:
            return self._stmt_events(s, func, consts)
        got = self._stmt.get(id(s))
        if got is None:
            got = self._stmt[id(s)] = self._stmt_events(s, func)
        return got

    def _stmt_events(self, s: ast.stmt, func: Func, consts: dict | None = None) -> list[tuple]:
        if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return []
        if isinstance(s, ast.If):
            head = self.expr_events(s.test, func, consts)
            taken = decide(s.test, consts) if consts else None
            if taken is not None:
                return head + self.block(s.body if taken else s.orelse, func, consts)
            a, b = self.block(s.body, func, consts), self.block(s.orelse, func, consts)
            if keys(a) == keys(b):
                return head + a
            first = (a or b)[0][1]
            return head + [(("choice", keys(a), keys(b)), first)]
        if isinstance(s, (ast.For, ast.AsyncFor, ast.While)):
            head = self.expr_events(s.iter if not isinstance(s, ast.While) else s.test, func, consts)
            body = self.block(s.body, func, consts)
            out = head + ([(("loop", keys(body)), body[0][1])] if body else [])
            return out + self.block(s.orelse, func, consts)
        if isinstance(s, (ast.With, ast.AsyncWith)):
            head = []
            for it in s.items:
                head += self.expr_events(it.context_expr, func, consts)
            return head + self.block(s.body, func, consts)
        if isinstance(s, ast.Try) or type(s).__name__ == "TryStar":
            return self.block(s.body, func, consts) + self.block(s.orelse, func, consts) + \
                self.block(s.finalbody, func, consts)
        if type(s).__name__ == "Match":
            return self.expr_events(s.subject, func, consts)
        return self.expr_events(s, func, consts)

    def expr_events(self, node: ast.AST, func: Func, consts: dict | None = None) -> list[tuple]:
        calls = self.calls_in(node, func)
        if not calls:
            return []
        branches = outer_ifexps(node)
        out: list[tuple] = []
        done: set[int] = set()
        for call in calls:
            owner = next((x for x in branches if _within(call, x)), None)
            if owner is None:
                out.extend(self.events_of_call(call, func, consts))
            elif id(owner) not in done:
                # `a() if cond else b()`: the test, then one side, as for an `if` statement (a
                # collective on one side only is a choice, not a call every rank makes)
                done.add(id(owner))
                out.extend(self.expr_events(owner.test, func, consts))
                taken = decide(owner.test, consts) if consts else None
                if taken is not None:
                    out.extend(self.expr_events(owner.body if taken else owner.orelse, func, consts))
                    continue
                a, b = self.expr_events(owner.body, func, consts), self.expr_events(owner.orelse, func, consts)
                if keys(a) == keys(b):
                    out.extend(a)
                elif a or b:
                    out.append((("choice", keys(a), keys(b)), (a or b)[0][1]))
        return out


def _within(inner: ast.AST, outer: ast.AST) -> bool:
    start = (inner.lineno, inner.col_offset)
    end = (inner.end_lineno or inner.lineno, inner.end_col_offset or 0)
    return (outer.lineno, outer.col_offset) <= start and end <= (outer.end_lineno or outer.lineno,
                                                                  outer.end_col_offset or 0)


def keys(events: list[tuple]) -> tuple:
    return tuple(k for k, _c in events)
