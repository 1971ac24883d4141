"""batchnorm-sync: BatchNorm in DDP models whose statistics are per rank where the program
probably assumes they are global.

From the ``bn`` records (rank/patches/batchnorm.py) and the replica digests (``replica``):
``convert_sync_batchnorm`` called after the module was wrapped in DDP (error), plain BatchNorm
normalising over a small per-rank batch (info, with each rank's batch size), and a checkpoint
saved from one rank while the ranks' BatchNorm running statistics differ (info), and BatchNorm
layers in train mode on some ranks and eval mode on others at the same training step (error,
``_bnmode.py``).
"""

from __future__ import annotations

from collections import defaultdict

from ._bnmode import mode_finding
from .base import Check, Context, Kind, fmt
from .replica_drift import replicas

#: Per-rank batches below this many samples give noisy BatchNorm statistics.
SMALL_BATCH = 32
_STATS = ("running_mean", "running_var")


class BatchnormSync(Check):
    id = "DD014"
    category = "batchnorm-sync"
    severity = "error"
    title = "convert_sync_batchnorm applied after DDP wrapping"
    fix = ("Convert before wrapping: `model = nn.SyncBatchNorm.convert_sync_batchnorm(model)`, then "
           "`model = DDP(model, ...)`. DDP records the module's layers, parameters and buffers when it "
           "is constructed.")
    kinds = {
        "small-batch": Kind(
            severity="info", title="BatchNorm statistics from small per-rank batches (no SyncBatchNorm)",
            fix=("If the per-rank batch is too small for stable statistics, convert the model with "
                 "nn.SyncBatchNorm.convert_sync_batchnorm(model) before wrapping it in DDP (statistics "
                 "over the global batch; on GPUs), or use GroupNorm/LayerNorm.")),
        "mode": Kind(
            title="BatchNorm layers in train mode on some ranks and eval mode on others at the same step",
            fix=("Switch modes on every rank together: call model.train() on all ranks before the next "
                 "training step (after an evaluation that one rank ran alone, too), and model.eval() on all "
                 "ranks, or evaluate a copy (model.module) without changing the training model's mode.")),
        "checkpoint-stats": Kind(
            severity="info", title="Checkpoint saved from one rank while BatchNorm statistics differ across ranks",
            fix=("Expected with plain BatchNorm under DDP (each rank's last batch updates its own running "
                 "statistics). To save statistics that represent every rank, use SyncBatchNorm or "
                 "all-reduce (average) the running_mean/running_var buffers before saving.")),
    }

    def run(self, ctx: Context):
        per: dict[int, dict[int, dict]] = defaultdict(dict)  # module id -> rank -> {layers, batch, convert}
        for rank, rt in ctx.run.ranks.items():
            for r in rt.records("bn"):
                d = per[int(r.get("id", 0) or 0)].setdefault(rank, {})
                d.setdefault(str(r.get("op")), r)
        out = []
        for idx, ranks in sorted(per.items()):
            conv = {r: d["convert"] for r, d in ranks.items() if "convert" in d}
            if conv:
                r0 = min(conv)
                out.append(self.finding(
                    f"nn.SyncBatchNorm.convert_sync_batchnorm at {ctx.where(r0, conv[r0].get('site'))} "
                    f"converts a model that DDP already wraps ({fmt(conv)}). DDP was built around the plain "
                    "BatchNorm layers; the conversion replaces them under it, which DDP does not support "
                    "(on CPU the wrapped SyncBatchNorm layers fail, on GPUs buffers and bucketing follow the "
                    "old layers).", sorted(conv), [ctx.loc(r0, conv[r0].get("site"), "convert")],
                    data={"module": idx, "op": "convert"}))
                continue
            layers = {r: d["layers"] for r, d in ranks.items() if "layers" in d}
            mode = mode_finding(self, ctx, idx, any(int(x.get("sbn", 0) or 0) for x in layers.values()))
            if mode is not None:
                out.append(mode)
            if not layers or any(int(x.get("sbn", 0) or 0) for x in layers.values()):
                continue
            if not all(int(x.get("bn", 0) or 0) for x in layers.values()):
                continue
            batches = {r: d["batch"].get("n") for r, d in ranks.items() if "batch" in d}
            sizes = [b for b in batches.values() if isinstance(b, int)]
            # DDP accepts SyncBatchNorm only for accelerator modules: on CPU there is nothing to
            # advise, per-rank statistics are the only kind DDP runs with.
            on_cpu = any(x.get("dev", "cpu") == "cpu" for x in layers.values())
            if sizes and max(sizes) < SMALL_BATCH and not on_cpu:
                r0 = min(layers)
                desc = "; ".join(f"rank {r}: {b}" for r, b in sorted(batches.items())[:8])
                out.append(self.finding(
                    f"The DDP model at {ctx.where(r0, layers[r0].get('site'))} has "
                    f"{layers[r0].get('bn')} BatchNorm layer(s) and no SyncBatchNorm; each rank normalises "
                    f"over its own batch of {desc} sample(s), not the global batch of {sum(sizes)}. "
                    "Small per-rank batches give noisy statistics (and running averages that differ "
                    "across ranks).", sorted(layers), [ctx.loc(r0, layers[r0].get("site"), "ddp")],
                    kind="small-batch", data={"module": idx, "batch": batches}))
            f = self._checkpoint_stats(ctx, idx)
            if f is not None:
                out.append(f)
        return out

    def _checkpoint_stats(self, ctx: Context, idx: int):
        reps = ctx.shared("replicas", replicas)
        saves = [(rank, r) for rank, mods in reps.items() if idx in mods
                 for r in mods[idx]["points"] if r.get("at") == "save"]
        for rank, save in saves:
            init = reps[rank][idx]["init"] or {}
            names = list(init.get("bnames") or [])
            stats = [i for i, n in enumerate(names) if n.rsplit(".", 1)[-1] in _STATS]
            if not stats:
                continue
            step = save.get("step")
            differ: dict[int, list[str]] = {}
            for other, mods in reps.items():
                if other == rank or idx not in mods:
                    continue
                theirs = [r for r in mods[idx]["points"] if r.get("step") == step]
                if not theirs:
                    continue
                b_mine, b_theirs = save.get("b") or [], theirs[-1].get("b") or []
                d = [names[i] for i in stats if i < len(b_mine) and i < len(b_theirs) and b_mine[i] != b_theirs[i]]
                if d:
                    differ[other] = d
            if differ:
                shown = sorted({n for d in differ.values() for n in d})
                return self.finding(
                    f"Rank {rank} saves a checkpoint at {ctx.where(rank, save.get('site'))} (after step {step}) "
                    f"holding its own BatchNorm running statistics; {fmt(differ)} hold(s) different ones "
                    f"({', '.join(shown[:6])}{' ...' if len(shown) > 6 else ''}). The checkpoint represents "
                    "rank {rank}'s batches only.".replace("{rank}", str(rank)), [rank, *differ],
                    [ctx.loc(rank, save.get("site"), "save")], kind="checkpoint-stats",
                    data={"module": idx, "step": step, "saver": rank})
        return None
