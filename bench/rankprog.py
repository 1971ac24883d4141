"""The program every rank of a benchmark job runs (``torchrun --nproc_per_node=2 bench/rankprog.py``).

It knows nothing of ddpdoctor: the same file runs plain, under ddpdoctor's environment injection,
and under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``. Each workload is timed inside the rank
(``perf_counter`` around the loop, after a warm-up and a barrier), never process start-up, and
written to ``--result-dir`` as ``rank<N>.json``. A workload that raises is recorded with its error
and the rank goes on to the next one when it still can.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn

#: name -> (calls in a full run, calls in --quick)
COUNTS = {
    "allreduce_1": (20000, 3000),
    "allreduce_1m": (2000, 200),
    "barrier": (5000, 1000),
    "broadcast": (5000, 1000),
    "all_gather_object": (2000, 400),
    "train": (300, 150),
}
WARMUP = 0.05  # fraction of the calls run before timing (at least 10)


def _collective(name: str):
    """(the call to time, what it works on)."""
    if name == "allreduce_1":
        x = torch.zeros(1)
        return lambda i: dist.all_reduce(x)
    if name == "allreduce_1m":
        x = torch.zeros(1 << 20)
        return lambda i: dist.all_reduce(x)
    if name == "barrier":
        return lambda i: dist.barrier()
    if name == "broadcast":
        x = torch.zeros(1)
        return lambda i: dist.broadcast(x, src=0)
    if name == "all_gather_object":
        out: list = [None] * dist.get_world_size()
        rank = dist.get_rank()
        return lambda i: dist.all_gather_object(out, {"rank": rank, "step": i})
    raise ValueError(name)


def run_collective(name: str, n: int) -> dict:
    call = _collective(name)
    for i in range(max(10, int(n * WARMUP))):
        call(i)
    dist.barrier()
    c0, p0 = time.thread_time(), time.process_time()
    t0 = time.perf_counter()
    for i in range(n):
        call(i)
    dt = time.perf_counter() - t0
    return {"seconds": dt, "calls": n, "cpu_main": time.thread_time() - c0, "cpu_proc": time.process_time() - p0}


#: In-process A/B (``--ab``, traced runs only): this many blocks, recording on and off in an ABBA
#: order so that a drift of the machine's load cancels out, over half the calls of the workload.
AB_ORDER = (1, 0, 0, 1, 1, 0, 0, 1, 1, 0)


def _recorder():
    rec_mod = sys.modules.get("ddpdoctor.rank.recorder")
    return rec_mod.get() if rec_mod is not None else None


def _ab(run_block, per: int) -> dict:
    """Blocks of ``per`` calls with ddpdoctor's recording on and off (``Recorder.enabled``)."""
    rec = _recorder()
    out: dict = {"calls": per, "on_s": [], "off_s": [], "on_cpu": [], "off_cpu": []}
    try:
        for b, on in enumerate(AB_ORDER):
            rec.enabled = bool(on)
            dist.barrier()
            c0, t0 = time.thread_time(), time.perf_counter()
            run_block(b, per)
            dt, cpu = time.perf_counter() - t0, time.thread_time() - c0
            out["on_s" if on else "off_s"].append(dt / per)
            out["on_cpu" if on else "off_cpu"].append(cpu / per)
    finally:
        rec.enabled = True
    return out


def ab_collective(name: str, n: int) -> dict:
    call = _collective(name)
    return _ab(lambda b, per: [call(i) for i in range(per)], max(10, n // (2 * len(AB_ORDER))))


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                                 nn.Linear(256, 10))

    def forward(self, x):
        return self.net(x)


def _trace_file() -> str | None:
    """This rank's ddpdoctor trace file when the job is traced (the bootstrap imported it)."""
    rec_mod = sys.modules.get("ddpdoctor.rank.recorder")
    rec = rec_mod.get() if rec_mod is not None else None
    w = getattr(rec, "writer", None)
    return getattr(w, "path", None)


def _trace_size(path: str | None) -> int:
    """Bytes of records in this rank's trace file so far: a mapped trace file is longer than
    its records while it is written (reserved space, see ddpdoctor/mappedtrace.py)."""
    rec_mod = sys.modules.get("ddpdoctor.rank.recorder")
    w = getattr(rec_mod.get() if rec_mod is not None else None, "writer", None)
    size = getattr(w, "size", None)
    return size() if size is not None else (os.path.getsize(path) if path else 0)


def run_train(steps: int, ckpt_dir: str, ab: bool = False) -> dict:
    """A small DDP training loop: DistributedSampler + set_epoch, SGD, a checkpoint per epoch
    (rank 0 saves, then a barrier)."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    rank, world = dist.get_rank(), dist.get_world_size()
    epochs, batch = 3, 32
    per_epoch = steps // epochs
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(per_epoch * batch * world, 64, generator=g),
                         torch.randint(0, 10, (per_epoch * batch * world,), generator=g))
    torch.manual_seed(0)
    model = DDP(_Model())
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=batch, sampler=sampler)

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return loss

    sampler.set_epoch(1000)  # warm-up: DDP rebuilds its buckets after the first iterations
    for i, (x, y) in enumerate(loader):
        if i == 10:
            break
        step(x, y)
    dist.barrier()
    path = _trace_file()
    size0 = _trace_size(path)
    ckpt = os.path.join(ckpt_dir, "ckpt.pt")
    c0, p0 = time.thread_time(), time.process_time()
    t0 = time.perf_counter()
    done = 0
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            step(x, y)
            done += 1
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "epoch": epoch}, ckpt)
        dist.barrier()
    dt = time.perf_counter() - t0
    out = {"seconds": dt, "calls": done, "cpu_main": time.thread_time() - c0,
           "cpu_proc": time.process_time() - p0}
    if path:
        out.update(trace_file=path, trace_from=size0, trace_to=_trace_size(path))
    if ab:
        def block(b: int, per: int) -> None:
            sampler.set_epoch(2000 + b)
            for i, (x, y) in enumerate(loader):
                if i == per:
                    break
                step(x, y)
            if rank == 0:
                torch.save({"model": model.module.state_dict(), "epoch": b}, ckpt)
            dist.barrier()

        out["ab"] = _ab(block, min(per_epoch, max(10, steps // (2 * len(AB_ORDER)))))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", required=True)
    ap.add_argument("--result-dir", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--pg-timeout", type=float, default=120)
    ap.add_argument("--scale", type=float, default=1.0, help="run this fraction of the calls")
    ap.add_argument("--ab", action="store_true", help="also an in-process A/B, recording on/off")
    args = ap.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.pg_timeout))
    rank = dist.get_rank()
    results: dict = {}
    ckpt_dir = tempfile.mkdtemp(prefix="ddpdoctor-bench-ckpt-") if rank == 0 else ""
    holder = [ckpt_dir]
    dist.broadcast_object_list(holder, src=0)
    for name in args.workloads.split(","):
        n = max(10, int(COUNTS[name][1 if args.quick else 0] * args.scale))
        try:
            ab = args.ab and _recorder() is not None
            if name == "train":
                results[name] = run_train(n, holder[0], ab)
            else:
                results[name] = run_collective(name, n)
                if ab:
                    results[name]["ab"] = ab_collective(name, n)
        except Exception as exc:  # DETAIL may reject what plain gloo accepts: record it
            results[name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}",
                             "where": traceback.format_exc(limit=3)[-600:]}
        with open(os.path.join(args.result_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
    dist.barrier()
    if rank == 0:
        import shutil

        shutil.rmtree(holder[0], ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
