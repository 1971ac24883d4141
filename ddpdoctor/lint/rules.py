"""The other static rules, one function each, mapped to the trace checks' ids.

DD002 a collective on a tensor whose size depends on the rank; DD003 a rank-guarded write of a
path read by other ranks with no collective between; DD004 splits, permutations and model
initialisation drawn from a rank-seeded (or, for splits, unseeded) generator; DD005 all_reduce
of a DDP model's gradients/parameters; DD007 a shuffling DistributedSampler without
``set_epoch`` in an epoch loop, ``DataLoader(sampler=..., shuffle=True)``; DD010 a barrier in a
DDP training loop; DD012 a collective after ``destroy_process_group``, ``new_group`` with
rank-dependent members, ``convert_sync_batchnorm`` after DDP wrapping.
"""

from __future__ import annotations

import ast
from typing import Iterator

from ..analysis.findings import Finding
from .comm import Comm, CommModel
from .finding import loc, make
from .names import dotted
from .program import Func, Program
from .rankdep import describe, is_heuristic

#: torch.nn layers whose weights are drawn at random when built.
RANDOM_LAYERS = frozenset({
    "Linear", "Bilinear", "LazyLinear", "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d",
    "ConvTranspose3d", "LazyConv1d", "LazyConv2d", "LazyConv3d", "Embedding", "EmbeddingBag", "RNN", "LSTM", "GRU",
    "RNNCell", "LSTMCell", "GRUCell", "MultiheadAttention", "Transformer", "TransformerEncoderLayer",
    "TransformerDecoderLayer", "TransformerEncoder", "TransformerDecoder",
})


def _canon(func: Func, node: ast.AST) -> str:
    return (func.module.imports.canonical(node) or "").replace(".distributed_c10d.", ".")


def _calls(func: Func) -> list[ast.Call]:
    return func.call_nodes


def _arg(call: ast.Call, idx: int, kw: str | None = None) -> ast.AST | None:
    if len(call.args) > idx and not isinstance(call.args[idx], ast.Starred):
        return call.args[idx]
    if kw is not None:
        for k in call.keywords:
            if k.arg == kw:
                return k.value
    return None


def _key(node: ast.AST | None) -> str | None:
    if node is None:
        return None
    try:
        return ast.unparse(node)
    except Exception:  # pragma: no cover - unparse handles every expression of a parsed file
        return None


def _strip_module(node: ast.AST) -> ast.AST:
    while isinstance(node, ast.Attribute) and node.attr == "module":
        node = node.value
    return node


class Rules:
    def __init__(self, prog: Program, cm: CommModel) -> None:
        self.prog = prog
        self.cm = cm
        self._set_epoch: list[str] | None = None
        self._any_seed: bool | None = None

    def run(self, enabled: set[str]) -> list[Finding]:
        out: list[Finding] = []
        # (id, rule, words one of which the module's source must contain for the rule to apply:
        # a cheap filter that keeps the linter fast on code that has nothing to do with it)
        table = [("DD002", self.rank_shaped, ("all_reduce", "broadcast", "reduce", "gather")),
                 ("DD003", self.missing_barrier, ("save", "open", "replace", "rename", "move", "copy")),
                 ("DD004", self.seeds, ("seed", "random_split")),
                 ("DD005", self.manual_allreduce, ("parameters",)),
                 ("DD007", self.sampler, ("DistributedSampler",)),
                 ("DD010", self.barrier_in_step, ("barrier",)),
                 ("DD012", self.misuse, ("destroy_process_group", "new_group", "convert_sync_batchnorm")),
                 ("DD011", self.p2p_counts, ("send", "recv"))]
        per_module: dict[str, list] = {}
        for f in self.prog.funcs:
            rules = per_module.get(f.module.path)
            if rules is None:
                src = f.module.source
                rules = per_module[f.module.path] = [rule for cid, rule, words in table
                                                     if cid in enabled and any(w in src for w in words)]
            if id(f) in self.prog.skipped:
                continue
            for rule in rules:
                try:
                    out.extend(rule(f))
                except RecursionError:
                    self.prog.skip(f)
        return out

    # -- DD005 -------------------------------------------------------------------------------------
    def manual_allreduce(self, func: Func) -> Iterator[Finding]:
        for node in func.scope:
            if not isinstance(node, (ast.For, ast.AsyncFor)) or not isinstance(node.iter, ast.Call):
                continue
            it = node.iter.func
            if not isinstance(it, ast.Attribute) or it.attr not in ("parameters", "named_parameters"):
                continue
            owner = _strip_module(it.value)
            k = self.cm.kind(owner, func, node.lineno)
            if k is None or k[0] not in ("ddp", "fsdp"):
                continue
            target = node.target
            if it.attr == "named_parameters" and isinstance(target, ast.Tuple) and len(target.elts) == 2:
                target = target.elts[1]
            p = dotted(target)
            if p is None:
                continue
            for call in (n for s in node.body for n in ast.walk(s) if isinstance(n, ast.Call)):
                canon = _canon(func, call.func)
                if not canon.startswith("torch.distributed.") or canon.rsplit(".", 1)[-1] not in (
                        "all_reduce", "reduce", "all_reduce_coalesced"):
                    continue
                arg = dotted(_arg(call, 0, "tensor") or ast.Constant(None)) or ""
                if arg in (f"{p}.grad", f"{p}.grad.data"):
                    sev, what = "error", "gradients"
                elif arg in (p, f"{p}.data"):
                    sev, what = "warning", "parameters"
                else:
                    continue
                model = dotted(owner) or "the model"
                msg = (f"{dotted(call.func)}() at line {call.lineno} reduces the {what} of `{model}`, which is "
                       f"wrapped in {'DistributedDataParallel' if k[0] == 'ddp' else 'FSDP'} (the loop at line "
                       f"{node.lineno}); DDP already averages gradients in backward, so this sums the averages "
                       f"(x world size) and costs a second all-reduce per parameter.")
                yield make("DD005", sev, msg, [loc(func.module, call.lineno, "call", func.name),
                                               loc(func.module, node.lineno, "loop", func.name)],
                           fix="Remove the manual all_reduce (DDP reduces gradients in backward); to change how "
                               "gradients are reduced, register a DDP communication hook.",
                           title_text=None if what == "gradients" else "Parameters of a DDP model reduced by hand")

    # -- DD007 -------------------------------------------------------------------------------------
    def _set_epoch_receivers(self, module) -> list[str]:
        """Receivers of ``.set_epoch()`` calls in the module."""
        if self._set_epoch is None:
            out = []
            for f in self.prog.funcs:
                for call in _calls(f):
                    if isinstance(call.func, ast.Attribute) and call.func.attr == "set_epoch":
                        out.append((f.module, dotted(call.func.value) or "?"))
            self._set_epoch = out
        return [r for m, r in self._set_epoch if m is module]

    def _is_sampler(self, expr: ast.AST, func: Func, line: int) -> ast.Call | None:
        if isinstance(expr, ast.Call):
            return expr if _canon(func, expr.func).rsplit(".", 1)[-1] == "DistributedSampler" else None
        key = dotted(expr)
        if key is None:
            return None
        value = self.prog.last_assignment(func, key, line)
        return self._is_sampler(value, func, line) if isinstance(value, ast.Call) else None

    def sampler(self, func: Func) -> Iterator[Finding]:
        loaders: dict[str, tuple[ast.Call, ast.AST, ast.Call]] = {}
        for call in _calls(func):
            if _canon(func, call.func).rsplit(".", 1)[-1] != "DataLoader":
                continue
            s_expr = _arg(call, 99, "sampler")
            if s_expr is None:
                continue
            ctor = self._is_sampler(s_expr, func, call.lineno)
            if ctor is None:
                continue
            shuffle = next((k.value for k in call.keywords if k.arg == "shuffle"), None)
            if isinstance(shuffle, ast.Constant) and shuffle.value is True:
                yield make("DD007", "error",
                           f"DataLoader at line {call.lineno} gets both a DistributedSampler and shuffle=True: "
                           f"DataLoader raises ValueError (sampler is mutually exclusive with shuffle) on every rank.",
                           [loc(func.module, call.lineno, "call", func.name)],
                           fix="Drop shuffle=True from the DataLoader; shuffle in the sampler "
                               "(DistributedSampler(..., shuffle=True)) and call sampler.set_epoch(epoch) each epoch.")
            loaders[id(call)] = (call, s_expr, ctor)
        if not loaders:
            return
        receivers = self._set_epoch_receivers(func.module)
        assigned = {}
        for _ln, target, value in self.prog.assignments(func):
            if isinstance(value, ast.Call) and id(value) in loaders:
                assigned[target] = loaders[id(value)]
        for node, outer in _loops_of(func):
            if outer is None:
                continue
            it = node.iter
            if isinstance(it, ast.Call) and dotted(it.func) in ("enumerate", "tqdm", "tqdm.tqdm", "iter") and it.args:
                it = it.args[0]
            entry = loaders.get(id(it)) if isinstance(it, ast.Call) else assigned.get(dotted(it) or "")
            if entry is None:
                continue
            call, s_expr, ctor = entry
            shuffle = next((k.value for k in ctor.keywords if k.arg == "shuffle"), None)
            if isinstance(shuffle, ast.Constant) and shuffle.value is False:
                continue
            s_name = dotted(s_expr) or ""
            l_name = dotted(it) or ""
            if any(r == s_name or r.endswith("." + s_name.split(".")[-1]) or r.endswith(".sampler")
                   or (l_name and r.startswith(l_name)) for r in receivers if r):
                continue
            yield make("DD007", "warning",
                       f"The loader iterated at line {node.lineno}, inside the loop at line {outer.lineno}, draws "
                       f"from a shuffling DistributedSampler (line {ctor.lineno}) whose set_epoch() is never "
                       f"called: it shuffles with the same seed every epoch, so every epoch sees the same order.",
                       [loc(func.module, node.lineno, "loop", func.name), loc(func.module, ctor.lineno, "call", func.name)],
                       fix="Call sampler.set_epoch(epoch) at the start of every epoch, before iterating the loader.")

    # -- DD003 -------------------------------------------------------------------------------------
    WRITES = {"torch.save": 1, "numpy.save": 0, "numpy.savez": 0, "torch.jit.save": 1, "os.replace": 1,
              "os.rename": 1, "shutil.move": 1, "shutil.copy": 1, "shutil.copyfile": 1, "shutil.copy2": 1}
    READS = {"torch.load": 0, "numpy.load": 0, "os.path.exists": 0, "os.path.isfile": 0, "os.path.isdir": 0,
             "os.path.getsize": 0, "os.listdir": 0, "torch.jit.load": 0, "pandas.read_csv": 0}

    def _file_ops(self, func: Func, stmts: list[ast.stmt], kind: str) -> list[tuple[str, int, str]]:
        table = self.WRITES if kind == "w" else self.READS
        out = []
        for s in stmts:
            for call in (n for n in ast.walk(s) if isinstance(n, ast.Call)):
                canon = _canon(func, call.func).replace("np.", "numpy.")
                path = None
                if canon in table:
                    path = _arg(call, table[canon], "f")
                elif canon == "open" or dotted(call.func) == "open":
                    mode = _arg(call, 1, "mode")
                    m = mode.value if isinstance(mode, ast.Constant) and isinstance(mode.value, str) else "r"
                    if (kind == "w") == any(c in m for c in "wax"):
                        path = _arg(call, 0, "file")
                elif isinstance(call.func, ast.Attribute):
                    a = call.func.attr
                    if (kind == "w" and a == "save_pretrained") or (kind == "r" and a == "from_pretrained"):
                        path = _arg(call, 0)
                if path is not None and self._in_memory(path, func, call.lineno):
                    continue
                k = _key(path)
                if k is not None and not isinstance(path, ast.Constant) or (
                        isinstance(path, ast.Constant) and isinstance(path.value, str)):
                    if self.prog.taint(func, path):
                        continue  # a per-rank path (`f"ckpt{rank}.pt"`): each rank has its own file
                    out.append((k, call.lineno, dotted(call.func) or canon))
        return out

    def _in_memory(self, path: ast.AST, func: Func, line: int) -> bool:
        """``torch.save(obj, buffer)`` with an io.BytesIO: no file involved."""
        if isinstance(path, ast.Call):
            return (dotted(path.func) or "").rsplit(".", 1)[-1] in ("BytesIO", "StringIO")
        key = dotted(path)
        value = self.prog.last_assignment(func, key, line + 1) if key else None
        return isinstance(value, ast.Call) and (dotted(value.func) or "").rsplit(".", 1)[-1] in ("BytesIO", "StringIO")

    def missing_barrier(self, func: Func) -> Iterator[Finding]:
        for stmts in _blocks_of(func):
            for i, s in enumerate(stmts):
                if not isinstance(s, ast.If):
                    continue
                t = self.prog.test_taint(func, s)
                if not t:
                    continue
                writes = self._file_ops(func, s.body, "w")
                if not writes:
                    continue
                if self.cm.block(s.body, func) or self.cm.block(s.orelse, func):
                    continue  # communication in the branches: the structural rule's business
                paths = {w[0]: w for w in writes}
                readers: list[tuple] = [(r, "in the other branch") for r in self._file_ops(func, s.orelse, "r")]
                for later in stmts[i + 1:]:
                    if self.cm.stmt(later, func) or _has_p2p_or_sync(self.cm, later, func):
                        break
                    if isinstance(later, ast.If) and self.prog.test_taint(func, later):
                        continue
                    readers += [(r, "after the branch, on every rank") for r in self._file_ops(func, [later], "r")]
                for (path, rline, rcall), where in readers:
                    w = paths.get(path)
                    if w is None:
                        continue
                    sev = "warning" if is_heuristic(t) else "error"
                    yield make("DD003", sev,
                               f"Ranks where `{ast.unparse(s.test)}` (line {s.lineno}) holds write `{path}` "
                               f"({w[2]}, line {w[1]}) and the file is read ({rcall}, line {rline}) {where} with no "
                               f"collective between: nothing orders the write before the read (a half-written or "
                               f"stale file). The condition depends on the rank through {describe(t)}.",
                               [loc(func.module, rline, "read", func.name), loc(func.module, w[1], "write", func.name),
                                loc(func.module, s.lineno, "condition", func.name)],
                               fix="Put a collective between the write and the reads (dist.barrier() after the "
                                   "rank-guarded save, outside the branch), or broadcast the object instead of "
                                   "passing it through the file system.")
                    break

    # -- DD004 -------------------------------------------------------------------------------------
    SEEDS_TORCH = ("torch.manual_seed", "torch.cuda.manual_seed", "torch.cuda.manual_seed_all", "torch.random.manual_seed")
    SEEDS_ALL = ("seed_everything", "set_seed", "seed_all", "fix_seed", "setup_seed", "init_seeds", "set_random_seed")

    def _module_seeds(self, module) -> bool:
        """Whether any code of the module seeds torch's generator."""
        if self._any_seed is None:
            self._any_seed = {}
        got = self._any_seed.get(module.path)
        if got is None:
            got = self._any_seed[module.path] = any(
                _canon(f, c.func) in self.SEEDS_TORCH or _canon(f, c.func).rsplit(".", 1)[-1] in self.SEEDS_ALL
                or (isinstance(c.func, ast.Attribute) and c.func.attr == "manual_seed")
                for f in self.prog.funcs if f.module is module for c in _calls(f))
        return got

    def seeds(self, func: Func) -> Iterator[Finding]:
        state: dict[str, tuple] = {}  # family -> ("rank", line, reason) | ("fixed", line)
        gens: dict[str, tuple] = {}
        wrapped = self._wrapped_models(func)
        for ln, target, value in self.prog.assignments(func):
            if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "manual_seed":
                t = self.prog.taint(func, value.args[0]) if value.args else frozenset()
                gens[target] = ("rank", ln, describe(t)) if t and not is_heuristic(t) else ("fixed", ln)
        for call in _calls(func):
            canon = _canon(func, call.func)
            last = canon.rsplit(".", 1)[-1]
            fams = ()
            if canon in self.SEEDS_TORCH:
                fams = ("torch",)
            elif canon == "random.seed":
                fams = ("python",)
            elif canon in ("numpy.random.seed", "np.random.seed"):
                fams = ("numpy",)
            elif last in self.SEEDS_ALL:
                fams = ("torch", "python", "numpy")
            if fams:
                a = _arg(call, 0, "seed")
                t = self.prog.taint(func, a) if a is not None else frozenset()
                for fam in fams:
                    state[fam] = ("rank", call.lineno, describe(t)) if t and not is_heuristic(t) else ("fixed", call.lineno)
                continue
            draw = None
            if last == "random_split" and canon.startswith("torch."):
                draw, fam, must = "random_split", "torch", "error"
            elif canon == "torch.randperm":
                draw, fam, must = "randperm", "torch", "warning"
            elif canon in ("random.shuffle", "random.sample"):
                draw, fam, must = canon, "python", "warning"
            elif canon.replace("np.", "numpy.") in ("numpy.random.permutation", "numpy.random.shuffle"):
                draw, fam, must = canon, "numpy", "warning"
            if draw is None:
                continue
            g = _arg(call, 99, "generator")
            st = gens.get(dotted(g) or "") if g is not None else state.get(fam)
            if g is not None and st is None:
                gt = self.prog.taint(func, g)
                st = ("rank", call.lineno, describe(gt)) if gt and not is_heuristic(gt) else None
            if st is not None and st[0] == "rank":
                yield make("DD004", must,
                           f"{draw} at line {call.lineno} draws from a generator seeded from the rank (line {st[1]}, "
                           f"through {st[2]}): every rank gets a different result where the ranks must agree "
                           f"(a split or order of shared data).",
                           [loc(func.module, call.lineno, "call", func.name), loc(func.module, st[1], "seed", func.name)],
                           fix="Draw it from a generator seeded the same on every rank "
                               "(generator=torch.Generator().manual_seed(SEED)); keep per-rank seeds for augmentation only.")
            elif st is None and draw == "random_split" and g is None and not self._module_seeds(func.module):
                yield make("DD004", "warning",
                           f"random_split at line {call.lineno} draws from torch's default generator, which no code in "
                           f"view seeds: each rank gets its own split (training and validation sets overlap "
                           f"across ranks).",
                           [loc(func.module, call.lineno, "call", func.name)],
                           fix="Pass generator=torch.Generator().manual_seed(SEED) with the same SEED on every rank.")
        # model initialisation under a rank-seeded torch generator, never synchronised
        seed_calls = [c for c in _calls(func) if _canon(func, c.func) in self.SEEDS_TORCH
                      or _canon(func, c.func).rsplit(".", 1)[-1] in self.SEEDS_ALL]
        for ln, target, value in self.prog.assignments(func):
            if not (isinstance(value, ast.Call) and self._is_module_ctor(value, func)):
                continue
            before = [c for c in seed_calls if c.lineno < ln]
            if not before:
                continue
            last_seed = before[-1]
            a = _arg(last_seed, 0, "seed")
            t = self.prog.taint(func, a) if a is not None else frozenset()
            if not t or is_heuristic(t) or target in wrapped or self._overwritten(func, target, ln):
                continue
            yield make("DD004", "error",
                       f"`{target}` is initialised at line {ln} from torch's generator seeded from the rank (line "
                       f"{last_seed.lineno}, through {describe(t)}) and never wrapped in DDP/FSDP or broadcast: every "
                       f"rank starts from different weights.",
                       [loc(func.module, ln, "call", func.name), loc(func.module, last_seed.lineno, "seed", func.name)],
                       fix="Seed the same on every rank before building the model (per-rank seeds after it), wrap it "
                           "in DDP (which broadcasts rank 0's weights), or broadcast its parameters.")

    def _is_module_ctor(self, call: ast.Call, func: Func, depth: int = 0) -> bool:
        """Whether a call builds a module with randomly initialised weights: a torch.nn layer
        that has them (not a loss, an activation or a norm layer, which start the same
        everywhere), a container of such layers, or a class of the analysed code that builds one."""
        canon = _canon(func, call.func)
        last = canon.rsplit(".", 1)[-1]
        if canon.startswith("torch.nn."):
            if last in RANDOM_LAYERS:
                return True
            if last in ("Sequential", "ModuleList") and depth < 4:
                return any(isinstance(a, ast.Call) and self._is_module_ctor(a, func, depth + 1) for a in call.args)
            return False
        cls = self.prog.class_named(last, func.module) if last in self.prog.classes else None
        if cls is None or depth >= 3 or not any("Module" in (dotted(b) or "") for b in cls.bases):
            return False
        for m in self.prog._class_funcs(cls):
            for c in m.call_nodes:
                if self._is_module_ctor(c, m, depth + 1):
                    return True
        return False

    def _overwritten(self, func: Func, target: str, line: int) -> bool:
        """Whether the module's weights are set afterwards (``m.weight = ...``,
        ``m.load_state_dict(...)``), which makes its random start irrelevant."""
        for ln, key, _v in self.prog.assignments(func):
            if ln > line and key.startswith(target + "."):
                return True
        for c in func.call_nodes:
            if c.lineno > line and isinstance(c.func, ast.Attribute) and c.func.attr in (
                    "load_state_dict", "copy_") and (dotted(c.func.value) or "").startswith(target):
                return True
        return False

    def _wrapped_models(self, func: Func) -> set[str]:
        """Names passed to DDP/FSDP, or whose parameters are broadcast, in this scope."""
        out = set()
        for call in _calls(func):
            last = _canon(func, call.func).rsplit(".", 1)[-1]
            if last in ("DistributedDataParallel", "DDP", "FullyShardedDataParallel", "FSDP", "fully_shard",
                        "prepare", "broadcast_parameters") and call.args:
                n = call.args[0]
                while isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
                    n = n.func.value
                if dotted(n):
                    out.add(dotted(n))
        for node in func.scope:
            if isinstance(node, (ast.For, ast.AsyncFor)) and isinstance(node.iter, ast.Call) and \
                    isinstance(node.iter.func, ast.Attribute) and node.iter.func.attr in ("parameters", "named_parameters"):
                if any(isinstance(c, ast.Call) and _canon(func, c.func).endswith(".broadcast")
                       for s in node.body for c in ast.walk(s)):
                    out.add(dotted(node.iter.func.value) or "")
        return out

    # -- DD010 -------------------------------------------------------------------------------------
    def barrier_in_step(self, func: Func) -> Iterator[Finding]:
        for node, _outer in _loops_of(func):
            # the barrier and the DDP step at the same loop level (a per-epoch barrier is fine)
            flat = [s for s in node.body if not isinstance(s, (ast.For, ast.AsyncFor, ast.While, ast.If))]
            direct = [c for s in flat for _k, c in self.cm.stmt(s, func)]
            barriers = [c for c in direct if c.op == "barrier" and not c.via]
            if barriers and any(c.op in ("ddp-backward", "ddp-forward") for c in direct):
                b = barriers[0]
                yield make("DD010", "info",
                           f"dist.barrier() at line {b.line} runs every iteration of the training loop at line "
                           f"{node.lineno}, whose DDP backward already synchronises the ranks: it adds a round trip "
                           f"per step and buys nothing.",
                           [loc(func.module, b.line, "call", func.name), loc(func.module, node.lineno, "loop", func.name)],
                           fix="Remove the per-step barrier; keep barriers where files or a single rank's work must be "
                               "ordered (e.g. after rank 0 saves a checkpoint).")

    # -- DD012 -------------------------------------------------------------------------------------
    def _destroys(self, func: Func, depth: int = 0) -> bool:
        for s in func.body:
            if isinstance(s, ast.Expr) and isinstance(s.value, ast.Call):
                c = s.value
                if _canon(func, c.func).endswith("destroy_process_group"):
                    return True
                callee, _b = self.prog.resolve(c, func)
                if callee is not None and depth < 3 and callee is not func and self._destroys(callee, depth + 1):
                    return True
        return False

    def misuse(self, func: Func) -> Iterator[Finding]:
        for stmts in _blocks_of(func):
            for i, s in enumerate(stmts):
                if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Call)):
                    continue
                c = s.value
                direct = _canon(func, c.func).endswith("destroy_process_group")
                callee = None if direct else self.prog.resolve(c, func)[0]
                if not direct and (callee is None or not self._destroys(callee)):
                    continue
                for later in stmts[i + 1:]:
                    calls = self.cm.calls_in(later, func)
                    if any(_canon(func, x.func).endswith("init_process_group") for x in calls):
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
        for call in _calls(func):
            canon = _canon(func, call.func)
            last = canon.rsplit(".", 1)[-1]
            if canon.startswith("torch.distributed.") and last == "new_group":
                ranks = _arg(call, 0, "ranks")
                t = self.prog.taint(func, ranks) if ranks is not None else frozenset()
                if t:
                    yield make("DD012", "warning" if is_heuristic(t) else "error",
                               f"new_group() at line {call.lineno} is called with members that depend on the rank "
                               f"(through {describe(t)}): every rank must create every group, with the same members, "
                               f"in the same order; otherwise the groups do not match across ranks.",
                               [loc(func.module, call.lineno, "call", func.name)],
                               fix="Create all groups on every rank, e.g. [dist.new_group(r) for r in all_member_lists], "
                                   "then pick the one this rank belongs to.")
            if last == "convert_sync_batchnorm" and call.args:
                k = self.cm.kind(_strip_module(call.args[0]), func, call.lineno)
                if k is not None and k[0] == "ddp":
                    yield make("DD012", "error",
                               f"convert_sync_batchnorm() at line {call.lineno} is applied to a model already wrapped "
                               f"in DistributedDataParallel: DDP registered the old BatchNorm modules' parameters and "
                               f"buffers, so the converted layers are not the ones it synchronises.",
                               [loc(func.module, call.lineno, "call", func.name)],
                               fix="Convert first, then wrap: DDP(nn.SyncBatchNorm.convert_sync_batchnorm(model)).")

    # -- DD011 -------------------------------------------------------------------------------------
    def p2p_counts(self, func: Func) -> Iterator[Finding]:
        from .simulate import Simulator

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
        for call in _calls(func):
            canon = _canon(func, call.func)
            last = canon.rsplit(".", 1)[-1]
            # broadcast is left out: its receivers size their buffer from metadata sent before
            if not canon.startswith("torch.distributed.") or last not in (
                    "all_reduce", "reduce", "all_gather_into_tensor", "reduce_scatter_tensor"):
                continue
            arg = _arg(call, 0, "tensor")
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
            canon = _canon(func, value.func)
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


def stmt_leaves(s: ast.stmt) -> bool:
    from .flow import stmt_exit

    return stmt_exit(s) is not None


def _has_p2p_or_sync(cm: CommModel, s: ast.stmt, func: Func) -> bool:
    for call in cm.calls_in(s, func):
        c = cm.classify(call, func)
        if isinstance(c, Comm):
            return True
    return False


def _blocks_of(func: Func) -> list[list[ast.stmt]]:
    got = func.__dict__.get("_blocks")
    if got is None:
        got = func.__dict__["_blocks"] = list(_blocks_gen(func))
    return got


def _blocks_gen(func: Func) -> Iterator[list[ast.stmt]]:
    node = func.node
    if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef)):
        yield node.body
    for n in func.scope:
        for field in ("body", "orelse", "finalbody"):
            sub = getattr(n, field, None)
            if isinstance(sub, list) and sub and isinstance(sub[0], ast.stmt):
                yield sub


def _loops_of(func: Func) -> list:
    got = func.__dict__.get("_loops")
    if got is None:
        got = func.__dict__["_loops"] = _loops_with_outer(func.node)
    return got


def _loops_with_outer(node: ast.AST):
    """(loop, enclosing loop or None) for every for/while loop in the scope."""
    out = []

    def visit(n, outer):
        for child in ast.iter_child_nodes(n):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                continue
            if isinstance(child, (ast.For, ast.AsyncFor, ast.While)):
                out.append((child, outer))
                visit(child, child)
            else:
                visit(child, outer)

    visit(node, None)
    return out
