"""sync-overhead, bad: a barrier before every DDP step, and rank 1 is slower at loading its data.

DDP's gradient all-reduce already synchronises the ranks every step, so the barrier adds a
round trip per step and buys nothing; and every step rank 0 waits for rank 1 (a straggler).
Run: ddpdoctor trace -- torchrun --nproc_per_node=2 checks/sync-overhead/bad.py
"""

import datetime
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS = int(os.environ.get("EXAMPLE_STEPS", "40"))


def load_batch(rank: int) -> torch.Tensor:
    if rank == 1:
        time.sleep(0.05)  # rank 1's data comes from a slower disk
    return torch.randn(4, 8)


def main() -> None:
    timeout = datetime.timedelta(seconds=float(os.environ.get("EXAMPLE_PG_TIMEOUT", "20")))
    dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(STEPS):
        x = load_batch(rank)
        dist.barrier()  # needless: the backward below synchronises anyway
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
