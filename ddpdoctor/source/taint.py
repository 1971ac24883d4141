"""Rank dependence, the primitives: which values, and so which conditions, differ from rank to rank.

A small taint analysis over ``ast`` (the analysed code is never imported). Sources: the rank
(``dist.get_rank()`` under any alias and for any group, ``get_node_local_rank()``,
``os.environ["RANK" | "LOCAL_RANK" | ...]``, the rank parameter of a function given to
``mp.spawn``/``ddpdoctor.spawn``, framework spellings such as ``accelerator.is_main_process`` or
``trainer.global_rank``). The taint flows through assignments, arithmetic, comparisons, calls,
attributes set once and read later (``self.gpu_id``), values assigned under a rank-dependent
condition, return values of the analysed functions and their parameters (across the files given).
Values that are the same everywhere stop it: the output of an all-reduce, broadcast or
all-gather of the whole world, the world size, a test of whether the rank is set at all
(``os.environ.get("RANK", -1) != -1``).

The public entry point for the rest of ddpdoctor is :func:`ddpdoctor.source.rankdep.condition_is_rank_dependent`.
A taint is a frozenset of reasons (empty: the same on every rank). A reason starting with ``~``
comes from a spelling only (a parameter called ``rank`` whose callers are not in view): findings
that rest on it are warnings. Reasons ``@N`` stand for "the N-th parameter" while a function's
summary is computed.
"""

from __future__ import annotations

import ast
from typing import Callable

from . import shards
from .names import Imports, dotted

Taint = frozenset
CLEAN: frozenset = frozenset()

#: Environment variables that hold a rank (torchrun, SLURM, Open MPI, MPICH/PMI, MVAPICH).
RANK_ENV = frozenset({
    "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "ROLE_RANK", "LOCAL_PROCESS_RANK",
    "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_NODE_RANK", "PMI_RANK", "PMIX_RANK",
    "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_LOCAL_RANK", "JSM_NAMESPACE_RANK", "JSM_NAMESPACE_LOCAL_RANK",
})
#: Canonical functions that return a rank.
RANK_FUNCS = frozenset({
    "torch.distributed.get_rank", "torch.distributed.get_node_local_rank",
    "torch.distributed.get_global_rank", "torch.distributed.get_group_rank",
    "torch.distributed.get_local_rank", "torch_xla.core.xla_model.get_ordinal",
    "torch_xla.core.xla_model.get_local_ordinal", "torch_xla.runtime.global_ordinal",
    "horovod.torch.rank", "horovod.torch.local_rank", "ignite.distributed.get_rank",
    "ignite.distributed.get_local_rank", "ignite.distributed.get_node_rank",
})
#: Function names (last part) that return a rank or a rank test when their body is not in view.
RANK_FUNC_NAMES = frozenset({
    "get_rank", "get_local_rank", "get_global_rank", "get_node_rank", "get_node_local_rank",
    "is_main_process", "is_local_main_process", "is_master", "is_rank_zero", "is_rank_0",
    "is_primary", "is_global_zero", "is_main", "is_master_process", "is_dist_main", "get_ordinal",
    "local_rank", "global_rank",
})
#: Attribute spellings of the rank in frameworks (Accelerate, Lightning, argparse conventions).
RANK_ATTRS = frozenset({
    "rank", "local_rank", "global_rank", "node_rank", "process_index", "local_process_index",
    "is_main_process", "is_local_main_process", "is_global_zero", "is_local_zero", "is_master",
    "is_main", "is_primary", "is_rank_zero", "global_rank_zero", "local_rank_zero",
})
#: Parameter names taken as a rank when no caller in view passes anything else.
RANK_PARAMS = frozenset({"rank", "local_rank", "global_rank", "node_rank", "rank_id", "world_rank", "proc_rank"})
#: Calls whose result is the same on every rank even when an argument is rank-dependent.
UNIFORM_FUNCS = frozenset({
    "torch.distributed.get_world_size", "torch.distributed.is_initialized", "torch.distributed.is_available",
    "torch.distributed.get_backend", "torch.distributed.get_process_group_ranks",
    "torch.utils.data.distributed.DistributedSampler", "torch.utils.data.DistributedSampler",
    "isinstance", "hasattr", "callable", "type",
})
UNIFORM_FUNC_NAMES = frozenset({"get_world_size", "world_size", "is_initialized", "is_available",
                                "gather_for_metrics", "mesh_reduce", "all_gather_object"})
UNIFORM_ATTRS = frozenset({"world_size", "num_processes", "num_replicas", "distributed_type", "device_type",
                           "use_distributed", "is_distributed", "num_nodes"})
#: Methods of an ``Accelerator``-like object whose result is the same everywhere.
UNIFORM_METHODS = frozenset({"gather", "reduce", "gather_for_metrics", "pad_across_processes",
                             "all_gather", "all_reduce", "broadcast", "mesh_reduce"})
#: In-place collectives of torch.distributed that make their first (tensor) argument, or their
#: output list, the same on every rank of the group: (function, index of that argument, keyword).
UNIFORMING = {
    "all_reduce": (0, "tensor"), "broadcast": (0, "tensor"), "all_gather": (0, "tensor_list"),
    "all_gather_into_tensor": (0, "output_tensor"), "broadcast_object_list": (0, "object_list"),
    "all_gather_object": (0, "object_list"), "all_reduce_coalesced": (0, "tensors"),
}
SENTINELS = (-1, None)
#: Keyword arguments of a DataLoader that change neither its items nor how many there are.
LOADER_KWARGS = frozenset({"num_workers", "worker_init_fn", "generator", "pin_memory", "pin_memory_device",
                           "prefetch_factor", "persistent_workers", "timeout", "multiprocessing_context",
                           "in_order", "collate_fn"})
#: Calls whose items are their first argument's (a progress bar, a counter).
PASS_THROUGH = frozenset({"tqdm", "trange", "enumerate", "track", "Progress"})
#: Methods and keyword arguments that place a value on this rank's device without changing it.
PLACEMENT_METHODS = frozenset({"to", "cuda", "pin_memory", "set_device"})
PLACEMENT_KWARGS = frozenset({"map_location", "device", "device_ids", "output_device", "non_blocking",
                              "device_id", "local_rank"})


def is_heuristic(taint: frozenset) -> bool:
    """True when every reason is a spelling only (``~``): the analysis is not sure."""
    return bool(taint) and all(r.startswith("~") for r in taint)


def describe(taint: frozenset) -> str:
    """The most telling reason, for a message (the rank before this rank's data)."""
    concrete = sorted((r for r in taint if not r.lstrip("~").startswith(("@", shards.SOURCE))),
                      key=lambda r: (r.lstrip("~").startswith(shards.DATA), r))
    if not concrete:
        return "a parameter"
    sure = [r for r in concrete if not r.startswith("~")]
    best = (sure or concrete)[0]
    if best.lstrip("~").startswith(shards.DATA):
        return shards.describe_data(best)
    return best.lstrip("~")


def env_key(node: ast.AST) -> str | None:
    """The key of an environment read ``os.environ[K]`` / ``os.environ.get(K)`` / ``os.getenv(K)``."""
    if isinstance(node, ast.Subscript) and dotted(node.value) in ("os.environ", "environ"):
        s = node.slice
        if isinstance(s, ast.Constant) and isinstance(s.value, str):
            return s.value
    if isinstance(node, ast.Call) and node.args:
        f = dotted(node.func)
        if f in ("os.environ.get", "environ.get", "os.getenv", "getenv", "os.environ.setdefault"):
            a = node.args[0]
            if isinstance(a, ast.Constant) and isinstance(a.value, str):
                return a.value
    return None


def _is_sentinel(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant) and node.value in SENTINELS and not isinstance(node.value, bool):
        return True
    return isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and \
        isinstance(node.operand, ast.Constant) and node.operand.value == 1


def presence_test(node: ast.Compare) -> bool:
    """``x != -1``, ``x is None``, ``x >= 0``, ``"RANK" in os.environ``: whether a rank is set at
    all, which is the same on every rank of a job."""
    if len(node.ops) != 1:
        return False
    op, right, left = node.ops[0], node.comparators[0], node.left
    if isinstance(op, (ast.In, ast.NotIn)) and dotted(right) in ("os.environ", "environ"):
        return True
    if isinstance(op, (ast.Eq, ast.NotEq, ast.Is, ast.IsNot)):
        return _is_sentinel(right) or _is_sentinel(left)
    if isinstance(op, (ast.GtE, ast.Lt)) and isinstance(right, ast.Constant) and right.value == 0:
        return True
    return isinstance(op, (ast.Gt, ast.LtE)) and _is_sentinel(right)


class Evaluator:
    """The taint of expressions in one scope, given a lookup for names/attributes and a resolver
    for calls into the analysed code."""

    def __init__(self, imports: Imports, lookup: Callable[[ast.AST, str], frozenset | None],
                 call_result: Callable[[ast.Call, list[frozenset], dict[str, frozenset]], frozenset | None],
                 extra_names: frozenset = CLEAN) -> None:
        self.imports = imports
        self.lookup = lookup  # (node, dotted key) -> taint, or None when unknown here
        self.call_result = call_result  # user functions: the summary's result, else None
        self.extra = extra_names

    def __call__(self, node: ast.AST | None) -> frozenset:
        if node is None:
            return CLEAN
        m = getattr(self, "_" + type(node).__name__, None)
        if m is not None:
            return m(node)
        out = CLEAN
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.expr):
                out = out | self(child)
        return out

    def _Constant(self, node):
        return CLEAN

    def _Lambda(self, node):
        return CLEAN

    def _Name(self, node: ast.Name):
        t = self.lookup(node, node.id)
        if t is not None:
            return t
        if node.id in self.extra:
            return frozenset({f"`{node.id}` (configured)"})
        return CLEAN

    def _Attribute(self, node: ast.Attribute):
        key = dotted(node)
        if key is not None:
            t = self.lookup(node, key)
            if t is not None:
                return t
        attr = node.attr
        if attr in UNIFORM_ATTRS:
            return CLEAN
        if attr in RANK_ATTRS or attr in self.extra:
            return frozenset({f"`{key or '.' + attr}`"})
        base = self(node.value)
        if attr in shards.SHAPE_ATTRS:  # a batch's shape: the same on every rank of a padded sampler
            return strip_data(base)
        # A field of a rank-dependent object: the analysis does not track fields one by one, so
        # this field may well be the same everywhere (a config, a test case): not sure. A field
        # of this rank's data (`batch.x`, `out.logits`) is data; a loader's field is not its items.
        return frozenset(r if r.startswith(shards.DATA) else "~" + r.lstrip("~")
                         for r in shards.strip_sources(base))

    def _Subscript(self, node: ast.Subscript):
        k = env_key(node)
        if k is not None:
            return frozenset({f"os.environ[{k!r}]"}) if (k in RANK_ENV or k in self.extra) else CLEAN
        return self(node.value) | self(node.slice)

    def _Compare(self, node: ast.Compare):
        if presence_test(node):
            return CLEAN
        out = self(node.left)
        for c in node.comparators:
            out = out | self(c)
        return out

    def _comp(self, node, parts):
        out = CLEAN
        for g in node.generators:
            out = out | shards.items(self(g.iter))
            for cond in g.ifs:
                out = out | self(cond)
        # the element's own taint (names bound by the comprehension carry the iterable's)
        for p in parts:
            out = out | self(p)
        return out

    def _ListComp(self, node):
        return self._comp(node, [node.elt])

    _SetComp = _ListComp
    _GeneratorExp = _ListComp

    def _DictComp(self, node):
        return self._comp(node, [node.key, node.value])

    def _Call(self, node: ast.Call):
        k = env_key(node)
        if k is not None:
            return frozenset({f"os.environ[{k!r}]"}) if (k in RANK_ENV or k in self.extra) else CLEAN
        func = node.func
        canon = self.imports.canonical(func) or ""
        canon = canon.replace(".distributed_c10d.", ".")
        last = canon.rsplit(".", 1)[-1] if canon else (func.attr if isinstance(func, ast.Attribute) else "")
        if canon in RANK_FUNCS:
            return frozenset({f"{dotted(func)}() (line {node.lineno})"})
        data = self._data_call(node, func, last)
        if data is not None:
            return data
        if canon in UNIFORM_FUNCS or last in UNIFORM_FUNC_NAMES:
            return CLEAN
        if canon.startswith("torch.distributed.") and last in UNIFORMING:
            return CLEAN
        if isinstance(func, ast.Attribute) and func.attr in UNIFORM_METHODS and \
                (dotted(func.value) or "").split(".")[-1] in ("accelerator", "xm", "accel", "fabric", "trainer"):
            return CLEAN
        if last in PASS_THROUGH and node.args:
            # progress bars and enumerate yield their first argument's items: `disable=rank != 0`
            # or `position=rank` changes what is printed, not what is iterated
            out = self(node.args[0])
            for a in node.args[1:]:
                self(a)
            for kw in node.keywords:
                self(kw.value)
            return out
        if isinstance(func, ast.Attribute) and func.attr in PLACEMENT_METHODS:
            # moving a value to this rank's device does not change it
            out = self(func.value)
            for a in node.args:
                self(a)  # still walked: names read here are recorded
            return out
        args = [self(a) for a in node.args]
        loader = last.lower().endswith("loader")
        kws = {}
        for kw in node.keywords:
            t = self(kw.value)
            # a loader's workers, seeds and memory pinning change neither its items nor their count
            kws[kw.arg or "**"] = CLEAN if kw.arg in PLACEMENT_KWARGS or (loader and kw.arg in LOADER_KWARGS) else t
        res = self.call_result(node, args, kws)
        if res is not None:
            return res
        if last in self.extra:
            return frozenset({f"{dotted(func)}() (line {node.lineno}, configured)"})
        if last in RANK_FUNC_NAMES:  # a helper out of view, known by its name only
            return frozenset({f"~{dotted(func)}() (line {node.lineno})"})
        out = CLEAN
        for t in args:
            out = out | t
        for t in kws.values():
            out = out | t
        if isinstance(func, ast.Attribute):
            out = out | self(func.value)
        if loader or last in shards.ITEM_PASSING:
            return out  # a loader built on a sharded sampler, or handing on its items: still sharded
        # anything else computed from a loader object (`model.parameters()` of a prepared model,
        # `loader.dataset`) is not its items
        return shards.strip_sources(out)

    def _data_call(self, node: ast.Call, func: ast.AST, last: str) -> frozenset | None:
        """Calls that start, pass on or end per-rank data (see ``shards``); None for the others."""
        line = node.lineno
        if last in shards.SAMPLERS:
            for a in node.args:
                self(a)
            for kw in node.keywords:
                self(kw.value)
            return shards.source(f"`{last}`", line)
        if isinstance(func, ast.Attribute) and func.attr == "prepare" and \
                (dotted(func.value) or "").rsplit(".", 1)[-1] in ("accelerator", "accel", "fabric"):
            out = CLEAN
            for a in node.args:
                out = out | self(a)
            return shards.strip_sources(out) | shards.source(f"`{dotted(func)}()`", line)
        if last == "next" and isinstance(func, ast.Name) and node.args:
            return shards.items(self(node.args[0]))
        if last == "len" and isinstance(func, ast.Name) and node.args:
            return strip_data(self(node.args[0]))  # a batch's length: the same on every rank
        if isinstance(func, ast.Attribute) and func.attr in shards.SHAPE_METHODS:
            out = strip_data(self(func.value))
            for a in node.args:
                out = out | self(a)
            return out
        return None


def strip_data(taint: frozenset) -> frozenset:
    """Without this rank's data and sources: what a shape read keeps (the rank, if any)."""
    return frozenset(r for r in taint if not r.lstrip("~").startswith((shards.DATA, shards.SOURCE)))


def weaken(taint: frozenset) -> frozenset:
    """The same reasons, marked as not sure (``~``)."""
    if not taint:
        return taint
    return frozenset(r if r.startswith("~") else "~" + r for r in taint)


def substitute(taint: frozenset, params: list[frozenset]) -> frozenset:
    """Replace ``@N`` markers (``~@N``: weakened) by the taint of the N-th argument (``@N*``:
    of its items, ``shards.items``)."""
    if not any(r.startswith(("@", "~@")) for r in taint):
        return taint
    out = set()
    for r in taint:
        if r.startswith("@") or r.startswith("~@"):
            weak = r.startswith("~")
            body = r.lstrip("~@")
            i = int(body.rstrip("*"))
            if i < len(params):
                p = shards.items(params[i]) if body.endswith("*") else params[i]
                out |= weaken(p) if weak else p
        else:
            out.add(r)
    return frozenset(out)
