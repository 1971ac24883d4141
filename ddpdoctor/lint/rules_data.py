"""DD004: splits, permutations and model initialisation drawn from a rank-seeded (or, for
splits, unseeded) generator; DD007: a shuffling DistributedSampler without ``set_epoch`` in an
epoch loop, ``DataLoader(sampler=..., shuffle=True)``."""

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
    calls_of,
    canon_of,
    loops_of,
)

#: torch.nn layers whose weights are drawn at random when built.
RANDOM_LAYERS = frozenset({
    "Linear", "Bilinear", "LazyLinear", "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d",
    "ConvTranspose3d", "LazyConv1d", "LazyConv2d", "LazyConv3d", "Embedding", "EmbeddingBag", "RNN", "LSTM", "GRU",
    "RNNCell", "LSTMCell", "GRUCell", "MultiheadAttention", "Transformer", "TransformerEncoderLayer",
    "TransformerDecoderLayer", "TransformerEncoder", "TransformerDecoder",
})


class DataRules(RuleFamily):
    """Randomness and data loading that must agree across ranks."""

    def __init__(self, prog, cm) -> None:
        super().__init__(prog, cm)
        self._set_epoch: list | None = None
        self._any_seed: dict | None = None

    def rules(self) -> list:
        return [("DD004", self.seeds, ("seed", "random_split")),
                ("DD007", self.sampler, ("DistributedSampler",))]

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
                canon_of(f, c.func) in self.SEEDS_TORCH or canon_of(f, c.func).rsplit(".", 1)[-1] in self.SEEDS_ALL
                or (isinstance(c.func, ast.Attribute) and c.func.attr == "manual_seed")
                for f in self.prog.funcs if f.module is module for c in calls_of(f))
        return got

    def seeds(self, func: Func) -> Iterator[Finding]:
        state: dict[str, tuple] = {}  # family -> ("rank", line, reason) | ("fixed", line)
        gens: dict[str, tuple] = {}
        wrapped = self._wrapped_models(func)
        for ln, target, value in self.prog.assignments(func):
            if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "manual_seed":
                t = self.prog.taint(func, value.args[0]) if value.args else frozenset()
                gens[target] = ("rank", ln, describe(t)) if t and not is_heuristic(t) else ("fixed", ln)
        for call in calls_of(func):
            canon = canon_of(func, call.func)
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
                a = argument(call, 0, "seed")
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
            g = argument(call, 99, "generator")
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
        seed_calls = [c for c in calls_of(func) if canon_of(func, c.func) in self.SEEDS_TORCH
                      or canon_of(func, c.func).rsplit(".", 1)[-1] in self.SEEDS_ALL]
        for ln, target, value in self.prog.assignments(func):
            if not (isinstance(value, ast.Call) and self._is_module_ctor(value, func)):
                continue
            before = [c for c in seed_calls if c.lineno < ln]
            if not before:
                continue
            last_seed = before[-1]
            a = argument(last_seed, 0, "seed")
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
        canon = canon_of(func, call.func)
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
        for call in calls_of(func):
            last = canon_of(func, call.func).rsplit(".", 1)[-1]
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
                if any(isinstance(c, ast.Call) and canon_of(func, c.func).endswith(".broadcast")
                       for s in node.body for c in ast.walk(s)):
                    out.add(dotted(node.iter.func.value) or "")
        return out

    # -- DD007 -------------------------------------------------------------------------------------
    def _set_epoch_receivers(self, module) -> list[str]:
        """Receivers of ``.set_epoch()`` calls in the module."""
        if self._set_epoch is None:
            out = []
            for f in self.prog.funcs:
                for call in calls_of(f):
                    if isinstance(call.func, ast.Attribute) and call.func.attr == "set_epoch":
                        out.append((f.module, dotted(call.func.value) or "?"))
            self._set_epoch = out
        return [r for m, r in self._set_epoch if m is module]

    def _is_sampler(self, expr: ast.AST, func: Func, line: int) -> ast.Call | None:
        if isinstance(expr, ast.Call):
            return expr if canon_of(func, expr.func).rsplit(".", 1)[-1] == "DistributedSampler" else None
        key = dotted(expr)
        if key is None:
            return None
        value = self.prog.last_assignment(func, key, line)
        return self._is_sampler(value, func, line) if isinstance(value, ast.Call) else None

    def sampler(self, func: Func) -> Iterator[Finding]:
        loaders: dict[str, tuple[ast.Call, ast.AST, ast.Call]] = {}
        for call in calls_of(func):
            if canon_of(func, call.func).rsplit(".", 1)[-1] != "DataLoader":
                continue
            s_expr = argument(call, 99, "sampler")
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
        for node, outer in loops_of(func):
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
