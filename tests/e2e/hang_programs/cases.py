"""Programs that hang (or stall) in the ways users hit, one per case, for the hang tests.

Usage: torchrun --nproc_per_node=N cases.py CASE   (the process-group timeout is long on
purpose: ddpdoctor's watchdog must diagnose the hang well before gloo would time out).
"""

import datetime
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def divergent(rank):
    x = torch.ones(2)
    dist.all_reduce(x)
    if rank == 0:
        dist.all_reduce(x)  # only rank 0
    dist.barrier()


def skip_barrier(rank):
    x = torch.ones(2)
    dist.all_reduce(x)
    if rank != 1:
        dist.barrier()
    dist.all_reduce(x)  # rank 1 arrives here while the others wait in the barrier


def raises(rank):
    # A non-daemon thread keeps the process alive after its main thread raised: the classic
    # "one rank crashed but the job does not end" hang.
    stop = threading.Event()
    threading.Thread(target=stop.wait, args=(60,), name="uploader").start()
    dist.barrier()
    try:
        if rank == 1:
            raise ValueError("bad batch on rank 1")
        dist.all_reduce(torch.ones(1))
    finally:
        if rank != 1:
            stop.set()


def sigkill(rank):
    for _ in range(3):
        dist.all_reduce(torch.ones(1))
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1))


def spin(rank):
    dist.barrier()
    if rank == 1:
        n = 0
        while True:  # stuck in a Python loop
            n += 1
    dist.all_reduce(torch.ones(1))


def _ddp(rank, with_buffers=False):
    torch.manual_seed(0)
    layers = [nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)]
    if with_buffers:
        layers.insert(1, nn.BatchNorm1d(8))
    return DDP(nn.Sequential(*layers))


def uneven(rank):
    model = _ddp(rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = 3 if rank == 0 else 4  # rank 1 has one more batch
    for _ in range(batches):
        opt.zero_grad()
        model(torch.randn(8, 4)).sum().backward()
        opt.step()
    dist.barrier()


def eval_rank0(rank):
    model = _ddp(rank, with_buffers=True)
    model(torch.randn(8, 4)).sum().backward()
    if rank == 0:
        model.eval()
        with torch.no_grad():
            model(torch.randn(8, 4))  # DDP forward broadcasts BatchNorm buffers: a collective
    dist.barrier()


def slow(rank):
    dist.barrier()
    if rank == 1:
        time.sleep(float(os.environ.get("SLOW_SECONDS", "6")))  # slow, but it gets there
    dist.all_reduce(torch.ones(1))
    dist.barrier()


CASES = {f.__name__: f for f in (divergent, skip_barrier, raises, sigkill, spin, uneven, eval_rank0, slow)}


def main():
    case = sys.argv[1]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(os.environ.get("EXAMPLE_PG_TIMEOUT", "60"))))
    CASES[case](dist.get_rank())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
