"""The program one rank runs for ``bench/instructions.py``: loops of one operation, separated by
markers that the counting tool sees.

A marker is ``os.getppid()``: one libc call (one ``getppid`` syscall) that neither torch, gloo
nor ddpdoctor makes. callgrind is started with ``--dump-before=getppid``, so each marker closes a
profile part (one file per part, all threads included), and strace's log is cut at its
``getppid`` lines. For each operation the program runs a warm-up loop, then a loop of N1 calls,
then a loop of N2 calls, each closed by a marker: per call = (part N2 - part N1) / (N2 - N1),
which takes start-up, warm-up and every fixed cost out. The labels of the parts, in order, are
written to ``--labels`` (JSON) at the end.

    python bench/instrprog.py --rank 0 --world 1 --port P --ops all_reduce,ddp --n1 200 --n2 600
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

OPS_WS1 = ("all_reduce", "broadcast", "barrier", "all_gather_into_tensor", "reduce_scatter_tensor", "ddp")
OPS_WS2 = ("isend_irecv", "fsdp2")
#: Steps are a hundred times as expensive as one collective: fewer of them.
STEP_OPS = ("ddp", "fsdp2")


def _marker(labels: list[str], label: str) -> None:
    os.getppid()  # see the module docstring: the boundary of a counted part
    labels.append(label)


def _workload(op: str, rank: int, world: int):
    """One call (or one training step) of ``op``, as a closure."""
    import torch
    import torch.distributed as dist

    if op == "all_reduce":
        t = torch.ones(1)
        return lambda: dist.all_reduce(t)
    if op == "broadcast":
        t = torch.ones(1)
        return lambda: dist.broadcast(t, 0)
    if op == "barrier":
        return dist.barrier
    if op == "all_gather_into_tensor":
        t, out = torch.ones(1), torch.empty(world)
        return lambda: dist.all_gather_into_tensor(out, t)
    if op == "reduce_scatter_tensor":
        t, out = torch.ones(world), torch.empty(1)
        return lambda: dist.reduce_scatter_tensor(out, t)
    if op == "isend_irecv":
        peer = 1 - rank
        t, r = torch.ones(1), torch.empty(1)

        def pair():
            # rank 0 sends first and rank 1 receives first; both post both before waiting
            if rank == 0:
                a, b = dist.isend(t, peer), dist.irecv(r, peer)
            else:
                b, a = dist.irecv(r, peer), dist.isend(t, peer)
            a.wait()
            b.wait()
        return pair
    if op in ("ddp", "fsdp2"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
        if op == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            model = DistributedDataParallel(model)
        else:
            from torch.distributed.fsdp import fully_shard

            fully_shard(model[0])
            fully_shard(model[2])
            fully_shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x, y = torch.randn(32, 64), torch.randn(32, 10)
        loss_fn = torch.nn.MSELoss()

        def step():
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
        return step
    raise SystemExit(f"unknown op {op!r}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--ops", required=True)
    ap.add_argument("--n1", type=int, required=True, help="calls of the first counted loop")
    ap.add_argument("--n2", type=int, required=True, help="calls of the second counted loop")
    ap.add_argument("--labels", help="where to write the labels of the parts (JSON)")
    ap.add_argument("--pg-timeout", type=float, default=900)
    a = ap.parse_args()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=a.rank,
                            world_size=a.world, timeout=datetime.timedelta(seconds=a.pg_timeout))
    labels: list[str] = []
    _marker(labels, "setup")
    for op in a.ops.split(","):
        scale = 10 if op in STEP_OPS else 1
        n1, n2 = max(1, a.n1 // scale), max(2, a.n2 // scale)
        fn = _workload(op, a.rank, a.world)
        for _ in range(max(5, n1 // 2)):  # warm-up: lazy init, caches, DDP's bucket rebuild
            fn()
        dist.barrier()
        _marker(labels, f"{op}:warmup")
        for _ in range(n1):
            fn()
        _marker(labels, f"{op}:{n1}")
        for _ in range(n2):
            fn()
        _marker(labels, f"{op}:{n2}")
    dist.barrier()
    dist.destroy_process_group()
    if a.labels:
        with open(a.labels, "w") as f:
            json.dump(labels, f)


if __name__ == "__main__":
    main()
