"""hang, bad: rank 0 evaluates alone through the DDP model; its forward broadcasts BatchNorm
buffers, a collective the other ranks never join (they wait in the barrier).

Run: ddpdoctor trace --hang-timeout 5 --on-hang kill -- torchrun --nproc_per_node=2 checks/hang/bad.py
"""

import datetime
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    timeout = datetime.timedelta(seconds=float(os.environ.get("EXAMPLE_PG_TIMEOUT", "60")))
    dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1)))
    model(torch.randn(8, 4)).sum().backward()
    if rank == 0:
        model.eval()
        with torch.no_grad():
            model(torch.randn(8, 4))  # a collective (buffer broadcast) on rank 0 only
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
