"""DD002: a collective on a tensor whose size depends on the rank; DD011: point-to-point sends
and receives whose counts cannot match; DD012: a collective after ``destroy_process_group``,
``new_group`` with rank-dependent members, ``convert_sync_batchnorm`` after DDP wrapping."""

from __future__ import annotations

import ast
from typing import Iterator

from ..analysis.findings import Finding
from ..source.names import dotted
from ..source.taint import describe, is_heuristic
from ..source.units import Func
from .finding import loc, make
from .rulekit import (
    RuleFamily,
    argument,
    blocks_of,
    calls_of,
    canon_of,
    stmt_leaves,
    strip_module,
)
from .simulate import Simulator


class CollectiveRules(RuleFamily):
    """How collectives, groups and point-to-point messages are used."""

    def rules(self) -> list:
        return [("DD002", self.rank_shaped, ("all_reduce", "broadcast", "reduce", "gather")),
                ("DD012", self.misuse, ("destroy_process_group", "new_group")),
                ("DD014", self.sync_batchnorm, ("convert_sync_batchnorm",)),
                ("DD011", self.p2p_counts, ("send", "recv"))]

    # -- DD012 -------------------------------------------------------------------------------------
    def _destroys(self, func: Func, depth: int = 0) -> bool:
        for s in func.body:
            if isinstance(s, ast.Expr) and isinstance(s.value, ast.Call):
                c = s.value
                if canon_of(func, c.func).endswith("destroy_process_group"):
                    return True
                callee, _b = self.prog.resolve(c, func)
                if callee is not None and depth < 3 and callee is not func and self._destroys(callee, depth + 1):
                    return True
        return False

    def misuse(self, func: Func) -> Iterator[Finding]:
        for stmts in blocks_of(func):
            for i, s in enumerate(stmts):
                if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Call)):
                    continue
                c = s.value
                direct = canon_of(func, c.func).endswith("destroy_process_group")
                callee = None if direct else self.prog.resolve(c, func)[0]
                if not direct and (callee is None or not self._destroys(callee)):
                    continue
                for later in stmts[i + 1:]:
                    calls = self.cm.calls_in(later, func)
                    if any(canon_of(func, x.func).endswith("init_process_group") for x in calls):
                        break
                    evs = self.cm.stmt(later, func)
                    if evs:
                        ev = evs[0][1]
                        via = f" (through {callee.name}())" if callee is not None else ""
                        yield make("DD012", "error",
                                   f"{ev.what} at line {ev.line} runs after the process group was destroyed at line "
                                   f"{s.lineno}{via}: it raises (\"Default process group has not been initialized\") "
                                   f"on every rank.",
                                   [loc(func.module, ev.line, "call", func.name), loc(func.module, s.lineno, "call", func.name)],
                                   fix="Destroy the process group last, after the final collective.")
                        break
                    if stmt_leaves(later):
                        break
        for call in calls_of(func):
            canon = canon_of(func, call.func)
            last = canon.rsplit(".", 1)[-1]
            if canon.startswith("torch.distributed.") and last == "new_group":
                ranks = argument(call, 0, "ranks")
                t = self.prog.taint(func, ranks) if ranks is not None else frozenset()
                if t:
                    yield make("DD012", "warning" if is_heuristic(t) else "error",
                               f"new_group() at line {call.lineno} is called with members that depend on the rank "
                               f"(through {describe(t)}): every rank must create every group, with the same members, "
                               f"in the same order; otherwise the groups do not match across ranks.",
                               [loc(func.module, call.lineno, "call", func.name)],
                               fix="Create all groups on every rank, e.g. [dist.new_group(r) for r in all_member_lists], "
                                   "then pick the one this rank belongs to.")
    # -- DD014 -------------------------------------------------------------------------------------
    def sync_batchnorm(self, func: Func) -> Iterator[Finding]:
        for call in calls_of(func):
            last = canon_of(func, call.func).rsplit(".", 1)[-1]
            if last == "convert_sync_batchnorm" and call.args:
                k = self.cm.kind(strip_module(call.args[0]), func, call.lineno)
                if k is not None and k[0] == "ddp":
                    yield make("DD014", "error",
                               f"convert_sync_batchnorm() at line {call.lineno} is applied to a model already wrapped "
                               f"in DistributedDataParallel: DDP registered the old BatchNorm modules' parameters and "
                               f"buffers, so the converted layers are not the ones it synchronises.",
                               [loc(func.module, call.lineno, "call", func.name)],
                               fix="Convert first, then wrap: DDP(nn.SyncBatchNorm.convert_sync_batchnorm(model)).")

    # -- DD011 -------------------------------------------------------------------------------------
    def p2p_counts(self, func: Func) -> Iterator[Finding]:
        if not any(isinstance(c, ast.Call) and isinstance(c.func, (ast.Attribute, ast.Name)) and
                   (dotted(c.func) or "").rsplit(".", 1)[-1] in ("send", "recv", "isend", "irecv")
                   for c in func.call_nodes):
            return
        sim = self.__dict__.setdefault("_sim", Simulator(self.prog, self.cm))
        bad = sim.p2p_mismatch(func)
        if bad is None:
            return
        a, b, n, m = bad["rank"], bad["peer"], bad["count"], bad["other"]
        verb, back = ("sends", "receives") if bad["kind"] == "send" else ("receives", "sends")
        prep = "to" if bad["kind"] == "send" else "from"
        other = f"rank {b} {back} {m} (line {bad['other_line']})" if bad["other_line"] else \
            f"rank {b} {back} none"
        locs = [loc(func.module, bad["line"], "call", func.name)]
        if bad["other_line"]:
            locs.append(loc(func.module, bad["other_line"], "call", func.name))
        yield make("DD011", "error",
                   f"Rank {a} {verb} {n} message(s) {prep} rank {b} (line {bad['line']}) but {other}: the extra "
                   f"call waits forever. Counted with constant loop bounds for every world size from 2 to 8 "
                   f"(with {bad['world']} ranks, for example); no size makes them match.",
                   locs, fix="Make every send match one receive on the peer (same count, same order).")

    # -- DD002 -------------------------------------------------------------------------------------
    FACTORIES = frozenset({"rand", "randn", "zeros", "ones", "empty", "full", "arange", "randint"})

    def rank_shaped(self, func: Func) -> Iterator[Finding]:
        for call in calls_of(func):
            canon = canon_of(func, call.func)
            last = canon.rsplit(".", 1)[-1]
            # broadcast is left out: its receivers size their buffer from metadata sent before
            if not canon.startswith("torch.distributed.") or last not in (
                    "all_reduce", "reduce", "all_gather_into_tensor", "reduce_scatter_tensor"):
                continue
            arg = argument(call, 0, "tensor")
            key = dotted(arg) if arg is not None else None
            if key is None:
                continue
            value = self.prog.last_assignment(func, key, call.lineno)
            size_t = self._size_taint(value, func)
            if size_t:
                yield make("DD002", "warning",
                           f"{dotted(call.func)}() at line {call.lineno} gets `{key}`, whose size depends on the rank "
                           f"(line {value.lineno}, through {describe(size_t)}): when the sizes differ, gloo aborts or "
                           f"the ranks wait forever.",
                           [loc(func.module, call.lineno, "call", func.name), loc(func.module, value.lineno, "write", func.name)],
                           fix="Agree on one size first (all_reduce the length with MAX, pad to it), or use "
                               "all_gather_object for variable-size data.")

    def _size_taint(self, value, func: Func) -> frozenset:
        if isinstance(value, ast.Call):
            canon = canon_of(func, value.func)
            last = canon.rsplit(".", 1)[-1]
            if canon.startswith("torch.") and last in self.FACTORIES:
                if last == "full":  # full(size, fill_value): only the size matters
                    sizes = value.args[:1]
                elif last == "randint":  # randint(low, high, size) / randint(high, size)
                    sizes = value.args[-1:] if len(value.args) >= 2 else []
                else:
                    sizes = list(value.args)
                sizes += [k.value for k in value.keywords if k.arg == "size"]
                t = frozenset()
                for a in sizes:
                    t = t | self.prog.taint(func, a)
                return t
        if isinstance(value, ast.Subscript) and isinstance(value.slice, ast.Slice):
            t = frozenset()
            for part in (value.slice.lower, value.slice.upper, value.slice.step):
                if part is not None:
                    t = t | self.prog.taint(func, part)
            return t
        return frozenset()
